"""opencode, headless: `opencode run --format json` with the prompt from TASK.md, JSON lines out.

The model is reached through the gateway's `openai` route by a provider fila defines in
OPENCODE_CONFIG_CONTENT (the bundled openai-compatible SDK; `{env:...}` reads the route's base URL
and the placeholder key the sandbox sets). State goes to XDG homes on the tmpfs HOME; autoupdate,
the models fetch and sharing are off. Edits are allowed, paths outside the job are denied, and the
policy's deny rules become opencode's own `permission` globs for reading and editing.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Policy, Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome, json_lines

PROVIDER = "fila"
DEFAULT_MODEL = "default"
RUN_FLAGS = ("--format", "--model", "json")


class OpencodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/-]+$")


def deny_globs(policy: Policy | None) -> list[str]:
    """The policy's .gitignore deny rules as opencode globs over paths in work/ (the run's cwd)."""
    globs: list[str] = []
    for pattern in policy.deny if policy else []:
        p = pattern.strip()
        if not p or p.startswith(("#", "!")):
            continue
        anchored = p.startswith("/") or "/" in p.rstrip("/")
        p = p.strip("/") + ("/**" if p.endswith("/") else "")
        for g in [p] if anchored else [p, f"**/{p}"]:
            globs += [g, f"{JOB_MOUNT}/work/{g}"]  # relative and absolute forms of the same path
    return globs


def config_content(model: str, policy: Policy | None) -> str:
    rules: dict[str, str] = {"*": "allow"} | dict.fromkeys(deny_globs(policy), "deny")
    config: dict[str, Any] = {
        "share": "disabled",
        "autoupdate": False,
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "fila gateway",
                "options": {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: {"name": model}},
            }
        },
        "model": f"{PROVIDER}/{model}",
        "permission": {"edit": rules, "read": rules, "external_directory": "deny"},
        # No extra title-generation call before the work: one model request less per run.
        "agent": {"title": {"disable": True}},
    }
    return json.dumps(config)


class OpencodeEngine(Engine):
    name = "opencode"
    Config = OpencodeConfig
    routes = ("openai",)
    version_argv = ("opencode", "--version")
    smoke = (Smoke(("opencode", "run", "--help"), RUN_FLAGS),)

    def invocation(self, task: Task) -> Invocation:
        return self.invocation_for(task, None)

    def invocation_for(self, task: Task, policy: Policy | None) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, OpencodeConfig)
        model = cfg.model or DEFAULT_MODEL
        args = ["--format", "json", "--model", f"{PROVIDER}/{model}"]
        # opencode takes the message as arguments only: TASK.md is read in the container and
        # passed as one argument (after "$@", never spliced into the script).
        # opencode installs @opencode-ai/plugin from npm into every writable config directory at
        # start (HOME is a fresh tmpfs, so every run: a denied request to registry.npmjs.org and
        # its wait); its config comes from OPENCODE_CONFIG_CONTENT, so the directory is made
        # read-only, which opencode takes as "nothing to install".
        conf = f"{HOME}/.config/opencode"
        script = (
            f"mkdir -p {conf} && chmod 555 {conf} && cd {JOB_MOUNT}/work || exit 97; "
            f'exec opencode run "$@" -- "$(cat {JOB_MOUNT}/TASK.md)"'
        )
        env = self.base_env() | {
            "OPENCODE_CONFIG_CONTENT": config_content(model, policy),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "XDG_CONFIG_HOME": f"{HOME}/.config",
            "XDG_DATA_HOME": f"{HOME}/.local/share",
            "XDG_CACHE_HOME": f"{HOME}/.cache",
            "XDG_STATE_HOME": f"{HOME}/.local/state",
        }
        return Invocation(argv=["/bin/sh", "-c", script, "fila-opencode", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        # Its --format json events, stdout only.
        events = [e for e in json_lines(output.out()) if "sessionID" in e or e.get("type") == "error"]
        if not events:
            return super().classify(exit_code, output)
        report = _report(events)
        error = next((e for e in reversed(events) if e.get("type") == "error"), None)
        if error is not None:
            status, message = _error_of(error)
            return error_outcome(status, message or "opencode: error event", report)
        if exit_code != 0:
            return Outcome("engine_error", f"opencode exited with code {exit_code}", report)
        return Outcome("success", str(report.get("message") or "")[:500], report)


def _error_of(event: dict[str, Any]) -> tuple[int | None, str]:
    err = event.get("error") or {}
    data = err.get("data") or {} if isinstance(err, dict) else {}
    status = data.get("statusCode") if isinstance(data, dict) else None
    message = (data.get("message") if isinstance(data, dict) else None) or err.get("name") or str(err)
    return (status if isinstance(status, int) else None), str(message)


def _report(events: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [e.get("part") or {} for e in events if e.get("type") == "step_finish"]
    tokens = [s.get("tokens") or {} for s in steps]
    costs = [s.get("cost") for s in steps if isinstance(s.get("cost"), int | float)]
    texts = [(e.get("part") or {}).get("text") for e in events if e.get("type") == "text"]
    return {
        "turns": len(steps) or None,
        "input_tokens": sum(int(t.get("input") or 0) for t in tokens) if steps else None,
        "output_tokens": sum(int(t.get("output") or 0) for t in tokens) if steps else None,
        "cost_usd": sum(costs) if costs else None,
        "session_id": next((e.get("sessionID") for e in events if e.get("sessionID")), None),
        "message": texts[-1] if texts else None,
    }
