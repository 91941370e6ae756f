"""The engines end to end: what each real CLI is scripted to do against the scripted model server
(tests/upstreams), the policy that routes it there, and its image."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker

from tests.support.cli import fila, run_once_console
from tests.support.policy import model_policy, model_route, write_policy
from tests.support.project import record
from tests.upstreams import Upstreams

KEY_VAR = "FILA_TEST_ENGINE_KEY"
HELLO = "hello from the model\n"
USAGE = ({"input_tokens": 150, "output_tokens": 40}, {"input_tokens": 260, "output_tokens": 9})


@dataclass(frozen=True)
class E2E:
    route: str  # the gateway route the engine's CLI talks to
    protocol: str  # the model server's protocol for that CLI
    model: str
    tool: dict[str, Any]  # the scripted tool call that writes work/hello.txt
    key_header: str  # where the real credential must arrive at the model server
    key_format: str


E2E_ENGINES = {
    "claude": E2E(
        "anthropic",
        "anthropic",
        "claude-sonnet-4-5",
        {"name": "Write", "arguments": {"file_path": "/job/work/hello.txt", "content": HELLO}},
        "x-api-key",
        "{key}",
    ),
    "codex": E2E(
        "openai",
        "responses",
        "gpt-5.5",
        {
            "name": "apply_patch",
            "input": f"*** Begin Patch\n*** Add File: /job/work/hello.txt\n+{HELLO}*** End Patch\n",
        },
        "authorization",
        "Bearer {key}",
    ),
    "opencode": E2E(
        "openai",
        "openai",
        "m1",
        {"name": "write", "arguments": {"filePath": "/job/work/hello.txt", "content": HELLO}},
        "authorization",
        "Bearer {key}",
    ),
    "gemini": E2E(
        "gemini",
        "gemini",
        "gemini-2.5-pro",
        {"name": "write_file", "arguments": {"file_path": "/job/work/hello.txt", "content": HELLO}},
        "x-goog-api-key",
        "{key}",
    ),
    "qwen": E2E(
        "openai",
        "openai",
        "qwen3-coder-plus",
        {"name": "write_file", "arguments": {"file_path": "/job/work/hello.txt", "content": HELLO}},
        "authorization",
        "Bearer {key}",
    ),
    # aider has no tools: its answer in the `whole` edit format names the file (one request).
    "aider": E2E("openai", "openai", "m1", {}, "authorization", "Bearer {key}"),
}


def model_script(spec: E2E) -> list[dict[str, Any]]:
    if not spec.tool:
        return [
            {"protocol": spec.protocol, "reply": {"text": f"hello.txt\n```\n{HELLO}```\n"}, "usage": USAGE[0]}
        ]
    return [
        {
            "protocol": spec.protocol,
            "when": "no_tool_result",
            "reply": {"tool": spec.tool},
            "usage": USAGE[0],
        },
        {
            "protocol": spec.protocol,
            "when": "tool_result",
            "reply": {"text": "Wrote hello.txt."},
            "usage": USAGE[1],
        },
    ]


def engine_policy(root: Path, ups: Upstreams, name: str, route: str) -> None:
    """policies/<name>.json: the engine's route to the scripted model server, its key KEY_VAR."""
    write_policy(root, name, model_policy(ups, {route: model_route(ups, KEY_VAR)}))


def engine_image(docker_client: docker.DockerClient, engine: str) -> None:
    """The engine's image, built when missing."""
    from fila.sandbox.docker.backend import DockerBackend
    from fila.sandbox.images import ensure_image

    ensure_image(engine, DockerBackend(docker_client), progress=lambda _l: None)


def run_engine_task(root: Path, engine: str, *extra: str, secret: str | None = None) -> dict[str, Any]:
    """Submit an engine task on a.txt under the engine's policy (`extra`: more submit options) and
    run it with `fila run --once` in a child process, as a user would; the record, with its log
    (`_log`) and fila's stderr (`_stderr`)."""
    spec = E2E_ENGINES[engine]
    secret = secret or f"sk-test-{secrets.token_hex(16)}"
    res = fila(
        root,
        *("submit", "--engine", engine, "--model", spec.model, "--target", "a.txt", "--policy", engine),
        *("--prompt", "Create hello.txt saying hello.", *extra),
        env={KEY_VAR: secret},
    )
    assert res.exit_code == 0, res.output
    tid = res.stdout.strip()
    done = run_once_console(root, {KEY_VAR: secret}, timeout=420)
    rec = record(root, tid)
    rec["_stderr"] = done.stderr
    rec["_log"] = (root / rec["log_path"]).read_text(errors="replace") if rec.get("log_path") else ""
    return rec
