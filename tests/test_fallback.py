"""Quota fallback: on `quota` the next engine runs on a fresh work/, every
attempt is in the record; the job's egress budget, `auth` and `engine_error` never fall back. Bad
input (an unknown fallback engine, one the policy's images or routes do not allow) is refused at
submit, exit 2, naming the field.

The end-to-end test runs the real claude CLI in its image through the egress gateway against the
scripted model server (tests/upstreams/README.md), falling back to the real shell engine.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.models import Policy, Task
from fila.run.job import fallback_chain
from fila.sandbox.docker.backend import DockerBackend
from tests.helpers import fila, make_root, record
from tests.upstreams.fixtures import Upstreams, upstreams  # noqa: F401  (the fixture)

KEY_VAR = "FILA_TEST_FALLBACK_KEY"
WRITE = {"name": "Write", "arguments": {"file_path": "/job/work/hello.txt", "content": "from claude\n"}}
RATE = "Number of request tokens has exceeded your per-minute rate limit"


def _policy(root: Path, ups: Upstreams, name: str, **extra: Any) -> None:
    route = {"upstream": "https://model.test", "credential": KEY_VAR, "ca_file": str(ups.ca_file)}
    egress: dict[str, Any] = {
        "routes": {"anthropic": route, "openai": route},
        "allow_private": [ups.subnet],
        "egress_network": ups.network,
        **extra.pop("egress", {}),
    }
    doc = {
        "network": "allowlist",
        "max_timeout_ms": 300_000,
        "default_timeout_ms": 240_000,
        "grace_ms": 2000,
        "egress": egress,
        **extra,
    }
    (root / "policies" / f"{name}.json").write_text(json.dumps(doc))


def _submit(root: Path, *args: str) -> str:
    res = fila(root, "submit", "--target", "a.txt", *args, env={KEY_VAR: "sk-test-submit"})
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def _run_once(root: Path, secret: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("fila")), "run", "--once", "--root", str(root)],
        env={**os.environ, KEY_VAR: secret},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _log(root: Path, rel: str | None) -> str:
    return (root / rel).read_text(errors="replace") if rel else ""


@pytest.fixture
def fb_root(
    tmp_path: Path,
    upstreams: Upstreams,  # noqa: F811
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> Path:
    from fila.sandbox.images import ensure_image

    for engine in ("claude", "codex", "shell"):
        ensure_image(engine, DockerBackend(docker_client), progress=lambda _l: None)
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    _policy(tmp_path, upstreams, "chain", fallback=["shell"])  # the policy's default chain
    _policy(tmp_path, upstreams, "budget", fallback=["shell"], egress={"max_requests": 1})
    return tmp_path


@pytest.mark.docker
@pytest.mark.engines
def test_quota_falls_back_on_a_fresh_work_dir_and_budget_auth_and_engine_error_never_do(
    fb_root: Path,
    upstreams: Upstreams,  # noqa: F811
) -> None:
    root, secret = fb_root, f"sk-test-{secrets.token_hex(16)}"
    shell_cmd = ("--command", "echo from shell >> a.txt")
    prompt = ("--prompt", "Create hello.txt.")

    # ALLOWED: claude writes hello.txt, then its model route answers 429 until the CLI gives up:
    # quota, so the policy's chain runs shell, on a fresh copy (claude's hello.txt is gone).
    upstreams.set_script(
        [
            {"protocol": "anthropic", "when": "no_tool_result", "reply": {"tool": WRITE}},
            *[{"protocol": "anthropic", "error": {"status": 429, "message": RATE, "retry_after": 0}}] * 12,
        ]
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "chain")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "needs_review", (rec["error"], done.stderr[-2000:])
    assert rec["engine"] == "shell" and rec["image"]["tag"] == "fila/shell:latest"
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [
        ("claude", "quota"),
        ("shell", "success"),
    ]
    first = rec["attempts"][0]
    assert first["error"]["kind"] == "quota"
    assert first["image"]["tag"] == "fila/claude:latest" and first["image"]["id"].startswith("sha256:")
    assert first["exit_code"] not in (0, None)
    # The model server really answered the CLI 429, and the gateway measured it for that attempt.
    got = upstreams.requests("model.test")
    assert got and got[0]["status"] == 200 and {r["status"] for r in got[1:]} == {429}
    assert first["egress"]["routes"]["anthropic"]["statuses"].get("429", 0) >= 1
    # Each engine's log is its own: claude's kept aside, shell's where the record points.
    assert first["log_path"] != rec["log_path"] and (root / first["log_path"]).is_file()
    assert first["log_path"] in first["error"]["message"] or "429" in first["error"]["message"]
    patch = (root / rec["patch_path"]).read_text()
    assert "+from shell" in patch
    assert "hello.txt" not in patch, "the fallback saw the first engine's work/"
    assert rec["diffstat"]["paths"] == ["a.txt"]
    shown = fila(root, "show", tid).stdout
    assert "fell back: claude out of quota" in shown and first["log_path"] in shown

    # BLOCKED: the job's egress budget (max_requests 1) ends claude's run with the gateway's own
    # 429: a fallback would get no new budget, so the task fails as quota, naming the budget.
    upstreams.set_script([{"protocol": "anthropic", "when": "no_tool_result", "reply": {"tool": WRITE}}])
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "budget")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed", done.stderr[-2000:]
    assert rec["error"]["kind"] == "quota" and "egress budget max_requests" in rec["error"]["message"]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("claude", "failed")]
    assert len(upstreams.requests("model.test")) == 1  # the second request never left the gateway

    # BLOCKED: auth never falls back (a fallback would not fix a key).
    upstreams.set_script(
        [{"protocol": "anthropic", "error": {"status": 401, "message": "invalid api key"}}] * 12
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "chain")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed", done.stderr[-2000:]
    assert rec["error"]["kind"] == "auth", rec["error"]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("claude", "failed")]
    assert "+from shell" not in _log(root, rec.get("patch_path"))

    # BLOCKED: an engine error never falls back: shell fails, claude (its fallback) never runs.
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "shell", "--command", "exit 3", *prompt, "--fallback", "claude",
                  "--policy", "chain")  # fmt: skip
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed" and rec["error"]["kind"] == "engine_error", done.stderr[-2000:]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("shell", "failed")]
    assert upstreams.requests("model.test") == []


def test_the_chain_is_the_tasks_fallback_else_the_policys_and_an_empty_list_means_none() -> None:
    pol = Policy.model_validate({"max_timeout_ms": 1000, "default_timeout_ms": 1000, "fallback": ["shell"]})
    task = Task(engine="claude", prompt="x", targets=["a"])
    assert [n for _f, n in fallback_chain(task, pol)] == ["claude", "shell"]
    own = task.model_copy(update={"fallback": ["codex", "claude", "codex"]})
    assert fallback_chain(own, pol) == [("engine", "claude"), ("fallback.0", "codex")]
    assert fallback_chain(task.model_copy(update={"fallback": []}), pol) == [("engine", "claude")]


# -- refused at submit, before any container: exit 2 naming the field -------------------------------


def _refusal_policy(root: Path, name: str, **doc: Any) -> None:
    # claude's route, so the case at hand is the one refused (network none refuses claude itself).
    base = {
        "max_timeout_ms": 60_000,
        "default_timeout_ms": 60_000,
        "network": "allowlist",
        "egress": {"routes": {"anthropic": {"credential": KEY_VAR}}},
    }
    (root / "policies" / f"{name}.json").write_text(json.dumps({**base, **doc}))


@pytest.fixture
def sub_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(KEY_VAR, "sk-test")
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    _refusal_policy(tmp_path, "default")
    _refusal_policy(tmp_path, "narrow", images=["fila/claude:*", "fila/shell:*"])
    _refusal_policy(tmp_path, "typo", fallback=["shel"])
    _refusal_policy(tmp_path, "anthropic-only")
    return tmp_path


CLAUDE = ("submit", "--target", "a.txt", "--engine", "claude", "--prompt", "x", "--command", "true")


@pytest.mark.parametrize(
    ("allowed", "refused", "field"),
    [
        # a fallback naming an unknown engine
        (("--fallback", "shell"), ("--fallback", "shell", "--fallback", "gpt"), "fallback.1"),
        # an unknown engine in the policy's default chain
        (("--fallback", "shell"), ("--policy", "typo"), "policy 'typo' fallback.0"),
        # a fallback whose image the policy does not allow
        (
            ("--policy", "narrow", "--fallback", "shell"),
            ("--policy", "narrow", "--fallback", "codex"),
            "fallback.0",
        ),
        # a fallback whose model route the allowlist policy has no credential for
        (
            ("--policy", "anthropic-only", "--fallback", "shell"),
            ("--policy", "anthropic-only", "--fallback", "codex"),
            "fallback.0",
        ),
    ],
)
def test_a_bad_fallback_is_refused_at_submit_naming_the_field(
    sub_root: Path, allowed: tuple[str, ...], refused: tuple[str, ...], field: str
) -> None:
    ok = fila(sub_root, *CLAUDE, *allowed, env={KEY_VAR: "sk-test"})
    assert ok.exit_code == 0, ok.output
    bad = fila(sub_root, *CLAUDE, *refused, env={KEY_VAR: "sk-test"})
    assert bad.exit_code == 2, bad.output
    assert f"field '{field}'" in bad.output, bad.output
    assert sorted(p.name for p in (sub_root / "fila" / "in").glob("*.json")) == [f"{ok.stdout.strip()}.json"]


def test_an_unknown_engine_is_refused_naming_the_field(sub_root: Path) -> None:
    assert (
        fila(sub_root, "submit", "--target", "a.txt", "--engine", "shell", "--command", "true").exit_code == 0
    )
    bad = fila(sub_root, "submit", "--target", "a.txt", "--engine", "shelll", "--command", "true")
    assert bad.exit_code == 2 and "field 'engine': unknown engine 'shelll'" in bad.output, bad.output
    assert "valid engines:" in bad.output


def test_a_prompt_over_the_policys_cap_is_refused_naming_the_field(sub_root: Path) -> None:
    _refusal_policy(sub_root, "short", max_prompt_bytes=1024)
    args = ("submit", "--target", "a.txt", "--engine", "claude", "--policy", "short", "--prompt")
    ok = fila(sub_root, *args, "é" * 512)  # 1024 bytes in UTF-8: at the cap
    assert ok.exit_code == 0, ok.output
    bad = fila(sub_root, *args, "é" * 512 + "x")
    assert bad.exit_code == 2 and "field 'prompt'" in bad.output and "max_prompt_bytes 1024" in bad.output


@pytest.mark.docker
@pytest.mark.engines
def test_the_tasks_own_chain_runs_in_order_until_an_engine_is_not_out_of_quota(
    fb_root: Path,
    upstreams: Upstreams,  # noqa: F811
) -> None:
    root = fb_root
    quota = {"error": {"status": 429, "message": RATE, "retry_after": 0}}
    upstreams.set_script(
        [*[{"protocol": "anthropic", **quota}] * 12, *[{"protocol": "responses", **quota}] * 12]
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", "--fallback", "codex", "--fallback", "shell",
                  "--prompt", "Create hello.txt.", "--command", "echo from shell >> a.txt",
                  "--policy", "chain")  # fmt: skip
    done = _run_once(root, f"sk-test-{secrets.token_hex(16)}")
    rec = record(root, tid)
    assert rec["status"] == "needs_review", (rec["error"], done.stderr[-2000:])
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [
        ("claude", "quota"),
        ("codex", "quota"),
        ("shell", "success"),
    ]
    kept = [a["log_path"] for a in rec["attempts"][:2]]
    assert kept == [f"fila/logs/{tid}.1-1-claude.log", f"fila/logs/{tid}.1-2-codex.log"]
    # Both CLIs really met the 429 (the model server logged each one's requests).
    paths = {r["path"].rsplit("/", 1)[-1] for r in upstreams.requests("model.test")}
    assert {"messages", "responses"} <= paths, paths
    assert "+from shell" in (root / rec["patch_path"]).read_text()
