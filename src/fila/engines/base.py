"""The adapter interface: how one engine CLI runs without a person at the keyboard.

An adapter translates a task into argv and environment for the engine's image, and classifies
the run afterwards (engines.md, "Classifying a run") from the backend's RunOutput: the CLI's
structured result is parsed from its stdout, whole; the text rules (quota, auth) read stderr's tail
and stdout. The exit code alone is not a reliable signal. The sandbox, not the adapter, enforces
time and limits.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ValidationError

from ..core import untrusted
from ..core.errors import InvalidTaskFile
from ..core.models import EgressRecord, EngineReport, Policy, Task
from ..core.output import RunOutput

OutcomeKind = Literal["success", "engine_error", "quota", "auth"]

QUOTA_RE = re.compile(
    r"\b429\b|rate.?limit|usage limit|hit your limit|quota|RESOURCE_EXHAUSTED"
    r"|credit balance is too low|insufficient credits",
    re.IGNORECASE,
)
AUTH_RE = re.compile(r"\b401\b|authentication|invalid api key|please run /login", re.IGNORECASE)


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    message: str = ""
    # What the CLI itself reported (model, turns, usage, cost), for the record's engine_report.
    report: dict[str, Any] | None = None


@dataclass(frozen=True)
class Smoke:
    """A build-time check of an engine image: `argv` runs in the image (as uid 65534, read-only
    root, no network) and its output must contain each of `expect` (the flags the adapter passes),
    so a renamed flag fails `fila images build`, not a user's job."""

    argv: tuple[str, ...]
    expect: tuple[str, ...]


@dataclass(frozen=True)
class Invocation:
    """What the sandbox runs: argv (also the entrypoint), the whole environment, secret values."""

    argv: list[str]
    env: dict[str, str]
    secrets: list[str] = field(default_factory=list)


# The container's cwd is the job directory, mounted here; work/ and TASK.md are inside it.
JOB_MOUNT = "/job"
HOME = "/home/fila"


class Engine(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]]
    # Host variables forwarded to this engine's container only, and redacted from its log.
    credential_vars: ClassVar[tuple[str, ...]] = ()
    # Model routes of the egress gateway this engine's CLI talks to (egress.KNOWN_ROUTES names).
    routes: ClassVar[tuple[str, ...]] = ()
    # True when the engine may call any route the policy gives (a command fila cannot read ahead).
    any_route: ClassVar[bool] = False
    # Build-time checks of the engine's image; `version_argv` must print the image's version label.
    version_argv: ClassVar[tuple[str, ...]] = ()
    smoke: ClassVar[tuple[Smoke, ...]] = ()

    def config(self, task: Task) -> BaseModel:
        """The engine's options from the task: `options.<engine>`, over the task's top-level fields
        of the same names (`command` in older task files, `prompt`, `model`). Errors name the field."""
        data = {k: getattr(task, k) for k in self.Config.model_fields if hasattr(task, k)}
        own = (task.options or {}).get(self.name) or {}
        for k, v in own.items():
            if data.get(k) is not None and v != data[k]:
                raise InvalidTaskFile(
                    f"{k!r} is given twice, differently: at the top level and in options.{self.name}",
                    field=f"options.{self.name}.{k}",
                    hint=f"keep one (options.{self.name}.{k} is the current form)",
                )
        data = {**data, **own}
        try:
            return self.Config.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field_name = ".".join(str(p) for p in err["loc"])
            if err["loc"] and err["loc"][0] in own:
                field_name = f"options.{self.name}.{field_name}"
            raise InvalidTaskFile(f"{err['msg']} (engine {self.name})", field=field_name) from None

    def image_tag(self) -> str:
        """The engine's image, built by `fila images build NAME` from images/NAME/Dockerfile."""
        return f"fila/{self.name}:latest"

    @abstractmethod
    def invocation(self, task: Task) -> Invocation: ...

    def invocation_for(self, task: Task, policy: Policy | None) -> Invocation:
        """The invocation with the policy's deny rules also written where the CLI reads its own
        (claude's permissions, gemini's policy rules, ...). Engines without such rules keep this."""
        return self.invocation(task)

    def base_env(self) -> dict[str, str]:
        return {
            "HOME": HOME,
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "CI": "1",
        }

    def credentials(self) -> tuple[dict[str, str], list[str]]:
        found = {k: os.environ[k] for k in self.credential_vars if os.environ.get(k)}
        return found, list(found.values())

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        """engines.md order, after fila's own timeout: quota, auth, non-zero exit, success. The
        text rules read stderr's tail and stdout (a CLI prints its errors to either)."""
        text = output.text()
        if QUOTA_RE.search(text):
            return Outcome("quota", _last_line_matching(text, QUOTA_RE))
        if AUTH_RE.search(text):
            return Outcome("auth", _last_line_matching(text, AUTH_RE))
        if exit_code != 0:
            return Outcome("engine_error", f"{self.name} exited with code {exit_code}")
        return Outcome("success")

    def classify_run(
        self, exit_code: int | None, output: RunOutput, egress: EgressRecord | None = None
    ) -> Outcome:
        """`classify`, then the gateway's word (engines.md: it beats the engine's): a run that did not
        succeed while a model route answered 429 is `quota`, 401/403 `auth`.

        A stdout cut at the log's cap (max_log_bytes; `output.stdout_truncated`) is read as far as
        it was kept: a result or error event seen before the cut decides as usual; when the result
        was past the cut, the adapter finds none and the text rules and the exit code decide, as for
        a CLI without structured output (the record warns that the log was cut).

        What the adapter reads is whatever the engine printed, and a hostile engine controls it
        (docs/engines.md, "Classification"). An adapter that fails on it (a field of another
        type, a nesting or a number past any limit) does not end the job: the text rules and the
        exit code decide, except that it is never a success (engine_error instead), and the
        message says the structured output could not be read. The outcome leaves this seam
        bounded (`within_limits`), so the record that holds it can always be read back."""
        try:
            o = self.classify(exit_code, output)
        except Exception as e:  # any failure to read the engine's own output
            # Never a success: fila did not read the result, and it may have been an error (aider
            # exits 0 after its API failed, and says so only in the text its adapter reads).
            said = Engine.classify(self, exit_code, output)
            why = f"its structured output could not be read ({type(e).__name__})"
            made: OutcomeKind = "engine_error" if said.kind == "success" else said.kind
            o = Outcome(made, f"{said.message}; {why}" if said.message else why)
        o = within_limits(o)
        if o.kind == "success" or not self.routes or egress is None:
            return o
        # The kept request lines are the first of the log only; each route's statuses are counted
        # whole (summary.json), so a route's 429 after hundreds of denials is still seen.
        statuses = {r.status for r in egress.requests if r.route is not None and r.status is not None}
        statuses |= {int(k) for rs in egress.routes.values() for k in rs.statuses if k.isdigit()}
        for kind, codes in (("quota", {429}), ("auth", {401, 403})):
            if o.kind != kind and statuses & codes:
                code = min(statuses & codes)
                msg = f"the model route answered HTTP {code} (gateway log); {o.message}"
                return Outcome(kind, msg, o.report)
        return o


# The record places a report a few levels deep (attempts[i].engine_report); its own fields are flat.
REPORT_LEVELS = 8
REPORT_TEXT = 1000  # a report's strings (model names, a session id): longer is cut


def within_limits(o: Outcome) -> Outcome:
    """The outcome with its message and report bounded (core/untrusted.bounded), every report
    field the record's EngineReport would refuse (a turn count that is a list, a model that is an
    object) set to None and its strings cut at REPORT_TEXT: the rest of the report is kept, as
    EngineReport reads it (a count given as "12" is 12)."""
    message = untrusted.bounded(o.message)
    if not isinstance(o.report, dict):
        return Outcome(o.kind, message)
    report = untrusted.bounded(o.report, levels=REPORT_LEVELS)
    try:
        read = EngineReport.model_validate(report)
    except ValidationError as e:
        bad = {err["loc"][0] for err in e.errors() if err["loc"]}
        read = EngineReport.model_validate({k: (None if k in bad else v) for k, v in report.items()})
    # Bounded again after EngineReport's coercions: "NaN" or a string of 40 digits is a valid
    # float or int to pydantic, and one no reader of the record accepts.
    report = untrusted.bounded(read.model_dump(exclude_unset=True), levels=REPORT_LEVELS)
    report = {k: v[:REPORT_TEXT] if isinstance(v, str) else v for k, v in report.items()}
    return Outcome(o.kind, message, report)


def error_outcome(status: int | None, message: str, report: dict[str, Any] | None = None) -> Outcome:
    """A CLI's structured error: its HTTP status first, then its message's words, else engine_error."""
    msg = message.strip()[:500]
    if status == 429 or QUOTA_RE.search(msg):
        return Outcome("quota", msg, report)
    if status in (401, 403) or AUTH_RE.search(msg):
        return Outcome("auth", msg, report)
    return Outcome("engine_error", msg, report)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a CLI's stdout, one a line; other lines (text a CLI prints among its
    events) are skipped. A line that is JSON but past a reader's limits (nesting past the
    recursion limit, an integer of thousands of digits) raises: it may have been the result, so
    the run is not read as if it had none (`classify_run` says it could not be read)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _last_line_matching(text: str, rx: re.Pattern[str]) -> str:
    # Split where the rules' `.` stops (a newline only): splitlines also splits at U+2028 and
    # the like, and a match spanning one would then be found on no line (an empty message).
    for line in reversed(text.split("\n")):
        if rx.search(line):
            return line.strip()[:300]
    return ""
