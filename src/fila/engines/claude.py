"""Claude Code, headless: `claude -p` with the prompt on stdin, one JSON result object on stdout.

Its model API is reached through the gateway's `anthropic` route (ANTHROPIC_BASE_URL and the
placeholder key come from the sandbox's gateway environment), its state lives on the tmpfs HOME,
edits and shell commands are auto-approved and nothing else is asked (`acceptEdits` with `Bash`
allowed: the container is the sandbox; a headless run denies the rest),
and the policy's deny rules become Claude's own `permissions.deny` (Read and Edit), besides the files
fila never copies. Classification reads the result object on stdout first (`is_error`,
`api_error_status`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Policy, Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome, json_lines

FLAGS = ("-p", "--output-format", "--permission-mode", "--model", "--settings")
# Few retries: a rate limit is fila's signal to fall back to another engine, not to wait minutes
# (the CLI's default retried a 429 for about three minutes).
MAX_RETRIES = "2"


class ClaudeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/\[\]-]+$")


def deny_rules(policy: Policy | None) -> list[str]:
    """The policy's deny rules as Claude permission rules. Both use .gitignore patterns; an anchored
    `/x` is relative to the project in fila and to a settings file in Claude, so it becomes `./x`."""
    rules: list[str] = []
    for pattern in policy.deny if policy else []:
        p = pattern.strip()
        if not p or p.startswith(("#", "!")):
            continue  # a re-allow has no deny to write; Claude's rules are deny-only here
        p = "./" + p[1:] if p.startswith("/") else p
        rules += [f"Read({p})", f"Edit({p})"]
    return rules


class ClaudeEngine(Engine):
    name = "claude"
    Config = ClaudeConfig
    routes = ("anthropic",)
    version_argv = ("claude", "--version")
    smoke = (Smoke(("claude", "--help"), FLAGS), Smoke(("claude", "--help"), ("acceptEdits", "json")))

    def invocation(self, task: Task) -> Invocation:
        return self.invocation_for(task, None)

    def invocation_for(self, task: Task, policy: Policy | None) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, ClaudeConfig)
        # Bash is allowed: the container is the sandbox, and running the project's own tests is
        # how an engine checks its change (docs/environments.md); the deny rules still hold.
        settings = {"permissions": {"allow": ["Bash"], "deny": deny_rules(policy)}}
        args = ["--output-format", "json", "--permission-mode", "acceptEdits"]
        args += ["--settings", json.dumps(settings)]
        if cfg.model:
            args += ["--model", cfg.model]
        # Arguments as "$@", never spliced into the script; the prompt is TASK.md on stdin.
        script = f'cd {JOB_MOUNT}/work || exit 97; exec claude -p "$@" < {JOB_MOUNT}/TASK.md'
        env = self.base_env() | {
            "CLAUDE_CONFIG_DIR": f"{HOME}/.claude",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_MAX_RETRIES": MAX_RETRIES,
        }
        return Invocation(argv=["/bin/sh", "-c", script, "fila-claude", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        # Its one result object, from stdout whole (however long its final message is).
        result = next((o for o in reversed(json_lines(output.out())) if o.get("type") == "result"), None)
        if result is None:
            return super().classify(exit_code, output)
        report = _report(result)
        message = str(result.get("result") or "")
        status = result.get("api_error_status")
        if result.get("is_error") or status:
            return error_outcome(status if isinstance(status, int) else None, message, report)
        if exit_code != 0:
            return Outcome("engine_error", f"claude exited with code {exit_code}: {message[:300]}", report)
        return Outcome("success", message[:500], report)


def _report(result: dict[str, Any]) -> dict[str, Any]:
    usage = result.get("usage") or {}
    models = result.get("modelUsage") or {}
    return {
        "model": ", ".join(models) or None,
        "turns": result.get("num_turns"),
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "cost_usd": result.get("total_cost_usd"),
        "session_id": result.get("session_id"),
        "permission_denials": len(result.get("permission_denials") or []),
    }
