"""The task format, `fila/in/<id>.json` (README.md, docs/architecture.md): what a task asks for
and the limits it may narrow its policy's to."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..states import ID_PATTERN
from .fields import Cpus, MemorySize, Pids, TaskMillis


class Limits(BaseModel):
    """What a task may ask for: each value must be at most the policy's."""

    model_config = ConfigDict(extra="forbid")
    memory: MemorySize | None = None
    cpus: Cpus | None = None
    pids: Pids | None = None


class Task(BaseModel):
    """A task file, `fila/in/<id>.json`."""

    model_config = ConfigDict(extra="forbid", title="fila task")

    id: str | None = Field(
        default=None,
        pattern=ID_PATTERN,
        description="task id; the file name's stem when absent. Letters, digits, '.', '_', '-'.",
    )
    prompt: str = Field(default="", description="what the engine is asked to do (TASK.md)")
    engine: str = Field(description="engine name: shell, claude, codex, ...")
    model: str | None = Field(default=None, description="model name passed to the engine")
    timeout: TaskMillis | None = Field(
        default=None, description="wall-clock limit in milliseconds; at least 1000, at most the policy's cap"
    )
    targets: list[str] = Field(min_length=1, description="paths relative to the project; directories allowed")
    policy: str = Field(default="default", pattern=ID_PATTERN, description="policy name")
    command: str | None = Field(
        default=None,
        description="shell engine: run with sh -c in work/ (the older form of options.shell.command)",
    )
    options: dict[Annotated[str, Field(pattern=ID_PATTERN)], dict[str, Any]] | None = Field(
        default=None,
        description='each engine\'s own options, under its name: {"shell": {"command": "make fmt"}}; only '
        "engines the task runs (its engine and fallback) may have an entry",
    )
    fallback: list[str] | None = Field(
        default=None,
        description="engines tried in turn when one reports quota, each on a fresh work/; "
        "absent: the policy's fallback chain; []: none",
    )
    project: str | None = Field(default=None, description="project directory (default: the queue root)")
    image: str | None = Field(default=None, description="engine image; must be allowed by policy")
    limits: Limits | None = Field(default=None, description="narrow the policy's resources")
    group: str | None = Field(
        default=None,
        pattern=ID_PATTERN,
        description="compare group: tasks on the same input, one per engine (`fila compare GROUP`)",
    )
    check: str | None = Field(
        default=None,
        min_length=1,
        description="command run by sh -c on a copy of work/ after the engine succeeds (shell image, "
        "network none); its exit status is recorded",
    )
    submitter: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="who or what queued it, as it says (e.g. mcp:<client> for the MCP server): shown, "
        "never trusted",
    )

    environment: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="the project environment the engine and the check run in: a declaration's path "
        'relative to the project (a devcontainer.json or fila-environment.json), or "none"; absent: '
        "the project's own .devcontainer/devcontainer.json, .devcontainer.json or fila-environment.json "
        "when it has one (docs/environments.md)",
    )
    environment_digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="what the project's environment must be made of (its base image's id, the "
        "declaration, the inputs: set by `fila submit` where it can tell): a runner whose own "
        "declaration or base image makes another fails the task (kind environment) rather than set "
        'up a different one (docs/environments.md, "Many hosts")',
    )

    @field_validator("targets")
    @classmethod
    def _targets_not_empty(cls, v: list[str]) -> list[str]:
        for t in v:
            if not t or "\x00" in t:
                raise ValueError("a target must be a non-empty path")
        return v
