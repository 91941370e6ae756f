"""Codex CLI, headless: `codex exec --json` with the prompt on stdin, JSON lines on stdout.

Codex ignores OPENAI_BASE_URL and refuses to redefine its `openai` provider, so fila defines its
own provider (`fila`, Responses wire API) with `-c` overrides pointing at the gateway's `openai`
route (OPENAI_BASE_URL, which the sandbox's gateway environment sets) and reading the placeholder
key from OPENAI_API_KEY. Codex's own sandbox (bubblewrap, landlock) cannot start inside fila's
container (no capabilities, no user namespaces: every write then fails), so it runs with
`danger-full-access`: fila's container is the sandbox. It never asks (exec mode approves nothing
interactively). Update checks, analytics and plugin fetches are off. Codex has no file deny rules:
the policy's deny list holds only through the files fila never copies.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome, json_lines

PROVIDER = "fila"
DEFAULT_MODEL = "gpt-5.5"  # a name codex knows: an unknown one gets no apply_patch tool
STATUS_RE = re.compile(r"\bstatus:? (\d{3})\b")
EXEC_FLAGS = ("--json", "--skip-git-repo-check", "--sandbox", "--model", "--config")


class CodexConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/-]+$")


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string for these values


class CodexEngine(Engine):
    name = "codex"
    Config = CodexConfig
    routes = ("openai",)
    version_argv = ("codex", "--version")
    smoke = (Smoke(("codex", "exec", "--help"), (*EXEC_FLAGS, "danger-full-access")),)

    def invocation(self, task: Task) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, CodexConfig)
        overrides = {
            "model_provider": _toml(PROVIDER),
            f"model_providers.{PROVIDER}.name": _toml("fila gateway"),
            f"model_providers.{PROVIDER}.env_key": _toml("OPENAI_API_KEY"),
            f"model_providers.{PROVIDER}.wire_api": _toml("responses"),
            # Few retries: a rate limit is fila's signal to fall back, not to wait.
            f"model_providers.{PROVIDER}.request_max_retries": "1",
            f"model_providers.{PROVIDER}.stream_max_retries": "1",
            "check_for_update_on_startup": "false",
            "analytics.enabled": "false",
            "features.plugins": "false",
            "features.apps": "false",
            "features.remote_plugin": "false",
        }
        args = ["--json", "--skip-git-repo-check", "--sandbox", "danger-full-access"]
        args += ["--model", cfg.model or DEFAULT_MODEL]
        for key, value in overrides.items():
            args += ["--config", f"{key}={value}"]
        # The base URL is known only in the container (the gateway's address): the script adds it.
        # Other arguments arrive as "$@", never spliced; the prompt is TASK.md on stdin ("-").
        script = (
            f'mkdir -p "$CODEX_HOME" && cd {JOB_MOUNT}/work || exit 97; '
            f'exec codex exec "$@" --config "model_providers.{PROVIDER}.base_url=\\"$OPENAI_BASE_URL\\"" '
            f"- < {JOB_MOUNT}/TASK.md"
        )
        env = self.base_env() | {"CODEX_HOME": f"{HOME}/.codex"}
        return Invocation(argv=["/bin/sh", "-c", script, "fila-codex", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        events = json_lines(output.out())  # its --json events, stdout only
        if not any(str(e.get("type", "")).startswith(("turn.", "thread.")) for e in events):
            return super().classify(exit_code, output)
        report = _report(events)
        failed = next((e for e in reversed(events) if e.get("type") == "turn.failed"), None)
        errors = [e for e in events if e.get("type") == "error"]
        if failed is not None or (errors and exit_code != 0):
            err = (failed or {}).get("error") or {}
            message = str(err.get("message") or (errors[-1].get("message") if errors else "") or "")
            return error_outcome(_status_in(message), message or "codex: turn failed", report)
        if exit_code != 0:
            return Outcome("engine_error", f"codex exited with code {exit_code}", report)
        return Outcome("success", str(report.get("message") or "")[:500], report)


def _status_in(message: str) -> int | None:
    """Codex puts the HTTP status in its error text ("unexpected status 401 Unauthorized: ...",
    "exceeded retry limit, last status: 429 Too Many Requests")."""
    m = STATUS_RE.search(message)
    return int(m.group(1)) if m else None


def _report(events: list[dict[str, Any]]) -> dict[str, Any]:
    done = [e for e in events if e.get("type") == "turn.completed"]
    usage: dict[str, int] = {}
    for e in done:
        for k, v in (e.get("usage") or {}).items():
            if isinstance(v, int):
                usage[k] = usage.get(k, 0) + v
    thread = next((e.get("thread_id") for e in events if e.get("type") == "thread.started"), None)
    messages = [
        (e.get("item") or {}).get("text")
        for e in events
        if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"
    ]
    return {
        "turns": len(done) or None,
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "cost_usd": None,  # codex reports no cost
        "session_id": thread,
        "message": messages[-1] if messages else None,
    }
