"""Aider, headless: `aider --message-file TASK.md --yes-always ...` on the files in work/.

The model is reached through the gateway's `openai` route (`--openai-api-base` from OPENAI_BASE_URL
and the placeholder OPENAI_API_KEY, both from the sandbox's gateway environment) as
`openai/<model>`, described in a model metadata file on the tmpfs HOME so litellm fetches no cost
map. No git, no update check, no analytics, no history files. Aider has no tools and no deny rules
of its own: it edits only the files it is given (those in work/, where fila never copies denied
files) and new files its answer names (`--yes-always`).

Aider prints text only, and after an API failure it retries for about a minute and then exits 0:
the classification reads its text on stdout (the last `litellm.*Error` with no edit applied after
it; aider prints its errors there too, in order).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome

DEFAULT_MODEL = "gpt-4.1"
FLAGS = (
    "--model",
    "--openai-api-base",
    "--model-metadata-file",
    "--message-file",
    "--yes-always",
    "--no-git",
    "--edit-format",
    "--no-pretty",
    "--no-fancy-input",
    "--no-check-update",
    "--analytics-disable",
    "--no-show-model-warnings",
    "--no-show-release-notes",
    "--chat-history-file",
    "--input-history-file",
)
ERROR_RE = re.compile(r"^litellm\.(\w+):\s*(.*)$", re.MULTILINE)
DONE_RE = re.compile(r"^(Applied edit to |Tokens: )", re.MULTILINE)
TOKENS_RE = re.compile(
    r"^Tokens: ([\d.,]+k?) sent, ([\d.,]+k?) received\.(?: Cost: \$([\d.]+) message, \$([\d.]+) session\.)?",
    re.MULTILINE,
)
# `Model: M` alone; `Main model: M` when the model has a weak model beside it (aider 0.86).
MODEL_RE = re.compile(r"^(?:Main model|Model): (\S+)", re.MULTILINE)


class AiderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/-]+$")


class AiderEngine(Engine):
    name = "aider"
    Config = AiderConfig
    routes = ("openai",)
    version_argv = ("aider", "--version")
    smoke = (Smoke(("aider", "--help"), FLAGS),)

    def invocation(self, task: Task) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, AiderConfig)
        model = f"openai/{cfg.model or DEFAULT_MODEL}"
        meta = {model: {"max_input_tokens": 128000, "max_output_tokens": 8192, "litellm_provider": "openai"}}
        meta[model]["mode"] = "chat"
        args = ["--model", model, "--model-metadata-file", f"{HOME}/fila-models.json"]
        args += [
            "--message-file",
            f"{JOB_MOUNT}/TASK.md",
            "--yes-always",
            "--no-git",
            "--edit-format",
            "whole",
        ]
        args += ["--no-pretty", "--no-fancy-input", "--no-check-update", "--analytics-disable"]
        args += ["--no-show-model-warnings", "--no-show-release-notes"]
        args += ["--chat-history-file", "/dev/null", "--input-history-file", "/dev/null"]
        # aider fetches litellm's price list from GitHub when its 24 h cache is missing (every run:
        # HOME is a fresh tmpfs); the copy litellm ships, put where aider caches it, stops the
        # fetch (a denied request in every record, and up to 5 s of start-up).
        cache = f"{HOME}/.aider/caches"
        setup = (
            f'printf %s "$FILA_AIDER_MODELS" > {HOME}/fila-models.json && mkdir -p {cache} && '
            f"cp /opt/aider/lib/python3*/site-packages/litellm/model_prices_and_context_window_backup.json "
            f"{cache}/model_prices_and_context_window.json"
        )
        # The files of work/ go to aider (it edits only files it is given); -x: one aider run or none.
        run = (
            'find . -type f ! -path "./.*" -print0 | '
            'exec xargs -0 -x sh -c \'exec aider "$@" </dev/null\' fila-aider "$@" '
            '--openai-api-base "$OPENAI_BASE_URL"'
        )
        script = f"{setup} && cd {JOB_MOUNT}/work || exit 97; {run}"
        env = self.base_env() | {
            "FILA_AIDER_MODELS": json.dumps(meta),
            "AIDER_CHECK_UPDATE": "false",
            "AIDER_ANALYTICS_DISABLE": "true",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        return Invocation(argv=["/bin/sh", "-c", script, "fila-aider", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        text = output.out()  # aider prints its messages and its errors to stdout, in order
        report = _report(text)
        errors = list(ERROR_RE.finditer(text))
        done = list(DONE_RE.finditer(text))
        if errors and (not done or done[-1].start() < errors[-1].start()):
            name, text = errors[-1].group(1), errors[-1].group(2)
            status = {"RateLimitError": 429, "AuthenticationError": 401, "PermissionDeniedError": 403}
            return error_outcome(status.get(name), f"{name}: {text}", report)
        if exit_code != 0:
            return super().classify(exit_code, output)
        if not done:
            return Outcome("engine_error", "aider exited 0 without an answer from the model", report)
        return Outcome("success", "", report)


def _count(s: str) -> int:
    s = s.replace(",", "")
    return int(float(s[:-1]) * 1000) if s.endswith("k") else int(float(s))


def _report(text: str) -> dict[str, Any]:
    lines = list(TOKENS_RE.finditer(text))
    model = MODEL_RE.search(text)
    report: dict[str, Any] = {"model": model.group(1) if model else None, "turns": len(lines) or None}
    if lines:
        report["input_tokens"] = sum(_count(m.group(1)) for m in lines)
        report["output_tokens"] = sum(_count(m.group(2)) for m in lines)
        session = lines[-1].group(4)
        report["cost_usd"] = float(session) if session else None
    return report
