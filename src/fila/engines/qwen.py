"""Qwen Code, headless: `qwen --auth-type openai -o stream-json --yolo PROMPT`, JSON lines out.

The model is reached through the gateway's `openai` route (OPENAI_BASE_URL and the placeholder
OPENAI_API_KEY come from the sandbox's gateway environment). State lives in QWEN_HOME on the tmpfs
HOME, usage statistics and telemetry are off. Every tool is auto-approved (yolo: nothing is asked;
fila's container is the sandbox), except what the policy denies: its deny rules become Qwen's own
`permissions.deny` (Read and Edit rules, the same syntax as Claude Code's) in QWEN_HOME/settings.json.
Classification reads the final `result` event on stdout (`is_error`) first, then the text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Policy, Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome, json_lines
from .claude import deny_rules

DEFAULT_MODEL = "qwen3-coder-plus"
STATUS_RE = re.compile(r"API Error: (\d{3})\b")
FLAGS = ("--auth-type", "--output-format", "--yolo", "--model", "stream-json", "openai")


class QwenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/-]+$")


class QwenEngine(Engine):
    name = "qwen"
    Config = QwenConfig
    routes = ("openai",)
    version_argv = ("qwen", "--version")
    smoke = (Smoke(("qwen", "--help"), FLAGS),)

    def invocation(self, task: Task) -> Invocation:
        return self.invocation_for(task, None)

    def invocation_for(self, task: Task, policy: Policy | None) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, QwenConfig)
        settings = {"permissions": {"deny": deny_rules(policy)}}
        args = ["--auth-type", "openai", "--output-format", "stream-json", "--yolo"]
        args += ["--model", cfg.model or DEFAULT_MODEL]
        setup = 'mkdir -p "$QWEN_HOME" && printf %s "$FILA_QWEN_SETTINGS" > "$QWEN_HOME/settings.json"'
        # The prompt is TASK.md, read in the container; stdin is closed (qwen reads a piped one).
        # qwen takes no "--" before its prompt; TASK.md starts with "# Task", never with a dash.
        run = f'exec qwen "$@" "$(cat {JOB_MOUNT}/TASK.md)" < /dev/null'
        script = f"{setup} && cd {JOB_MOUNT}/work || exit 97; {run}"
        env = self.base_env() | {
            "QWEN_HOME": f"{HOME}/.qwen",
            "QWEN_USAGE_STATISTICS_ENABLED": "false",
            "QWEN_TELEMETRY_ENABLED": "false",
            "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
            "FILA_QWEN_SETTINGS": json.dumps(settings),
        }
        return Invocation(argv=["/bin/sh", "-c", script, "fila-qwen", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        events = json_lines(output.out())  # its stream-json events, stdout only
        result = next((o for o in reversed(events) if o.get("type") == "result"), None)
        if result is None:
            return super().classify(exit_code, output)
        report = _report(result, events)
        message = str(result.get("result") or result.get("error") or "")
        if result.get("is_error"):
            err = result.get("error")
            if isinstance(err, dict):
                message = str(err.get("message") or message)
            m = STATUS_RE.search(message)  # "[API Error: 429 ...]"
            status = int(m.group(1)) if m else None
            return error_outcome(status, message or "qwen: the run ended in an error", report)
        if exit_code != 0:
            return Outcome("engine_error", f"qwen exited with code {exit_code}: {message[:300]}", report)
        return Outcome("success", message[:500], report)


def _report(result: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    usage = result.get("usage") or {}
    # The model the CLI named: its stats when it gives them, else the assistant messages'.
    models = dict.fromkeys(((result.get("stats") or {}).get("models")) or {})  # ordered, each once
    for e in events:
        name = (e.get("message") or {}).get("model") if e.get("type") == "assistant" else None
        if isinstance(name, str):
            models.setdefault(name)
    return {
        "model": ", ".join(models) or None,
        "turns": result.get("num_turns"),
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "cost_usd": None,  # qwen reports no cost
        "session_id": result.get("session_id"),
        "permission_denials": len(result.get("permission_denials") or []),
    }
