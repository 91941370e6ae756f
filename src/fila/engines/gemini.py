"""Gemini CLI, headless: `gemini -p PROMPT --output-format json --approval-mode yolo`.

The model is reached through the gateway's `gemini` route (GOOGLE_GEMINI_BASE_URL and the
placeholder GEMINI_API_KEY come from the sandbox's gateway environment); the API-key auth type, no
usage statistics and no telemetry are written to its settings on the tmpfs HOME before it starts
(without the auth type a headless run exits 41). The workspace is trusted for the run
(an untrusted folder silently downgrades yolo). The policy's deny rules become Gemini's own policy
rules (`--policy`): the file tools are denied on matching paths. Classification reads the JSON
result on stdout (`error`; the CLI prints an error object on stderr instead, which is read when
stdout has none) and the exit code first, then the text (its warnings are on stderr).
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Policy, Task
from .base import HOME, JOB_MOUNT, Engine, Invocation, Outcome, RunOutput, Smoke, error_outcome

DEFAULT_MODEL = "gemini-2.5-pro"
FLAGS = ("--prompt", "--output-format", "--approval-mode", "--model", "--policy", "yolo", "json")
SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}
FILE_TOOLS = ("read_file", "write_file", "replace", "read_many_files")
# Exit codes the CLI documents or was seen using: 41 auth, 42 bad input, 53 turn limit; 147 was
# seen for an HTTP 403.
AUTH_EXITS = {41, 147}
MAX_TRIES = 16  # candidate starts of gemini's JSON result, from the end of stdout


class GeminiConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._:@/-]+$")


def policy_toml(policy: Policy | None) -> str:
    """The policy's .gitignore deny rules as Gemini policy rules over the file tools' path argument
    (a regular expression over the tool's JSON arguments)."""
    rules = []
    for pattern in policy.deny if policy else []:
        p = pattern.strip()
        if not p or p.startswith(("#", "!")):
            continue
        anchored = p.startswith("/") or "/" in p.rstrip("/")
        rx = fnmatch.translate(p.strip("/")).removeprefix("(?s:").removesuffix(")\\Z").replace(".*", '[^"/]*')
        # Simple patterns only: the CLI refuses a rule whose regex nests quantifiers (ReDoS check).
        prefix = re.escape(f"{JOB_MOUNT}/work/") if anchored else '[^"]*/'
        end = "/" if p.endswith("/") else '"'
        args = f'"(?:file_path|absolute_path|path)":"{prefix}{rx}{end}'
        for tool in FILE_TOOLS:
            rules.append(
                f'[[rule]]\ntoolName = "{tool}"\nargsPattern = {json.dumps(args)}\n'
                'decision = "deny"\npriority = 900\n'
            )
    return "\n".join(rules)


class GeminiEngine(Engine):
    name = "gemini"
    Config = GeminiConfig
    routes = ("gemini",)
    version_argv = ("gemini", "--version")
    smoke = (Smoke(("gemini", "--help"), FLAGS),)

    def invocation(self, task: Task) -> Invocation:
        return self.invocation_for(task, None)

    def invocation_for(self, task: Task, policy: Policy | None) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, GeminiConfig)
        args = ["--output-format", "json", "--approval-mode", "yolo", "--model", cfg.model or DEFAULT_MODEL]
        rules = policy_toml(policy)
        settings = '"$GEMINI_CLI_HOME/.gemini/settings.json"'
        setup = f'mkdir -p "$GEMINI_CLI_HOME/.gemini" && printf %s "$FILA_GEMINI_SETTINGS" > {settings}'
        if rules:
            setup += ' && printf %s "$FILA_GEMINI_POLICY" > "$GEMINI_CLI_HOME/fila-deny.toml"'
            args += ["--policy", f"{HOME}/fila-deny.toml"]
        # The prompt is TASK.md, read in the container; the other arguments arrive as "$@".
        run = f'exec gemini "$@" --prompt "$(cat {JOB_MOUNT}/TASK.md)"'
        script = f"{setup} && cd {JOB_MOUNT}/work || exit 97; {run}"
        env = self.base_env() | {
            "GEMINI_CLI_HOME": HOME,
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
            "FILA_GEMINI_SETTINGS": json.dumps(SETTINGS),
        }
        if rules:
            env["FILA_GEMINI_POLICY"] = rules
        return Invocation(argv=["/bin/sh", "-c", script, "fila-gemini", *args], env=env)

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        result = last_json_object(output.out())  # its JSON result, stdout only
        if result is None:
            result = _error_on_stderr(output)
        if result is None or not ({"session_id", "response", "error", "stats"} & result.keys()):
            if exit_code in AUTH_EXITS:
                return Outcome("auth", f"gemini exited with code {exit_code} (authentication)")
            return super().classify(exit_code, output)
        report = _report(result)
        error = result.get("error")
        if error:
            message = str(error.get("message") if isinstance(error, dict) else error)
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else None
            outcome = error_outcome(status, message, report)
            if outcome.kind == "engine_error" and exit_code in AUTH_EXITS:
                return Outcome("auth", outcome.message, report)
            return outcome
        if exit_code != 0:
            return Outcome("engine_error", f"gemini exited with code {exit_code}", report)
        return Outcome("success", str(result.get("response") or "")[:500], report)


def _error_on_stderr(output: RunOutput) -> dict[str, Any] | None:
    """gemini prints its JSON *error* object to stderr (its error handler), its result to stdout.
    With no result on stdout, an error object on stderr is read: it can only make the run an
    error, never a success (a `response` there is not taken)."""
    obj = last_json_object(output.stderr.decode(errors="replace"))
    if obj is None or not obj.get("error"):
        return None
    return {"error": obj["error"], "session_id": obj.get("session_id")}


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object in the text (gemini prints it indented over many lines;
    text before it is skipped)."""
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"(?m)^\{", text)]
    # The last few candidates only: stdout is read whole (up to max_log_bytes), and a hostile engine
    # could print many lines that open objects never closed (each try scans to the end).
    for start in reversed(starts[-MAX_TRIES:]):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:  # past a limit (nesting, digits) raises: see base.json_lines
            continue
        if isinstance(obj, dict):
            return obj
    return None


def _report(result: dict[str, Any]) -> dict[str, Any]:
    models = ((result.get("stats") or {}).get("models")) or {}
    tokens = [(m.get("tokens") or {}) for m in models.values()]
    api = [(m.get("api") or {}) for m in models.values()]
    return {
        "model": ", ".join(models) or None,
        "turns": sum(int(a.get("totalRequests") or 0) for a in api) if api else None,
        "input_tokens": sum(int(t.get("prompt") or t.get("input") or 0) for t in tokens) if tokens else None,
        "output_tokens": sum(int(t.get("candidates") or 0) for t in tokens) if tokens else None,
        "cost_usd": None,  # gemini reports no cost
        "session_id": result.get("session_id"),
        "message": result.get("response"),
    }
