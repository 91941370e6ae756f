"""The adapter interface: how one engine CLI runs without a person at the keyboard.

An adapter translates a task into argv and environment for the engine's image, and classifies
the run afterwards (engines.md, "Classifying a run"): the exit code alone is not a reliable
signal, so the log text is read too. The sandbox, not the adapter, enforces time and limits.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ValidationError

from ..errors import InvalidTaskFile
from ..models import Task

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

    def config(self, task: Task) -> BaseModel:
        """The engine's options from the task; errors name the task field."""
        data = {k: getattr(task, k) for k in self.Config.model_fields if hasattr(task, k)}
        try:
            return self.Config.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field_name = ".".join(str(p) for p in err["loc"])
            raise InvalidTaskFile(f"{err['msg']} (engine {self.name})", field=field_name) from None

    def image_tag(self) -> str:
        """The engine's image, built by `fila images build NAME` from images/NAME/Dockerfile."""
        return f"fila/{self.name}:latest"

    @abstractmethod
    def invocation(self, task: Task) -> Invocation: ...

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

    def classify(self, exit_code: int | None, log_tail: str) -> Outcome:
        """engines.md order, after fila's own timeout: quota, auth, non-zero exit, success."""
        if QUOTA_RE.search(log_tail):
            return Outcome("quota", _last_line_matching(log_tail, QUOTA_RE))
        if AUTH_RE.search(log_tail):
            return Outcome("auth", _last_line_matching(log_tail, AUTH_RE))
        if exit_code != 0:
            return Outcome("engine_error", f"{self.name} exited with code {exit_code}")
        return Outcome("success")


def _last_line_matching(text: str, rx: re.Pattern[str]) -> str:
    for line in reversed(text.splitlines()):
        if rx.search(line):
            return line.strip()[:300]
    return ""
