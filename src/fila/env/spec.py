"""The one form of a project environment (docs/environments.md, "Declaring"): what a
`.devcontainer/devcontainer.json` or fila's own `fila-environment.json` becomes once read, whichever
the project used. Paths are relative to the project and are checked against it (`declare`) before
anything is read or built.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import ENV_NAME_PATTERN

# Where the project's files are in every container of an environment: the setup runs there, so
# what it installs in the project tree (node_modules, .venv with its absolute shebangs) is where
# the engine and the check find it (engines.base.JOB_MOUNT + "/work").
PROJECT_PATH = "/job/work"

RelPath = Annotated[str, Field(min_length=1, max_length=1024)]
MAX_STEPS = 64
MAX_COMMAND_CHARS = 64 << 10


class Build(BaseModel):
    """A Dockerfile the environment's base is built from (devcontainer `build`)."""

    model_config = ConfigDict(extra="forbid")
    dockerfile: RelPath = Field(description="the Dockerfile, relative to the project")
    context: RelPath = Field(default=".", description="the build context, relative to the project")
    args: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN)], str] = Field(default_factory=dict)
    target: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Step(BaseModel):
    """One setup command. `shell`: run by `/bin/sh -c`; `argv`: run as it is (exec form);
    commands of one step with several `parallel` entries run at once, as the spec runs an object's
    named commands, and the step fails when one of them does."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="where it came from: onCreateCommand, postCreateCommand:deps, setup[0]")
    shell: str | None = Field(default=None, max_length=MAX_COMMAND_CHARS)
    argv: list[Annotated[str, Field(max_length=MAX_COMMAND_CHARS)]] | None = Field(default=None, min_length=1)
    parallel: list[Step] | None = Field(default=None, min_length=1)


class EnvSpec(BaseModel):
    """A project environment as fila runs it. Exactly one of `image` and `build`."""

    model_config = ConfigDict(extra="forbid", title="fila environment")

    name: str | None = Field(default=None, max_length=200, description="for display")
    image: str | None = Field(default=None, description="the base image (must be allowed by the policy)")
    build: Build | None = Field(default=None, description="or a Dockerfile to build the base from")
    env: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN)], str] = Field(
        default_factory=dict, description="variables set in every container of the environment (containerEnv)"
    )
    setup: list[Step] = Field(
        default_factory=list, max_length=MAX_STEPS, description="run once per key, in order"
    )
    inputs: list[RelPath] = Field(
        default_factory=list,
        description="project files the setup reads (lockfiles): copied into the setup, and part of the key; "
        "nothing else of the project is there",
    )
    provided: list[RelPath] = Field(
        default_factory=list,
        description="directories of the project tree the setup makes (node_modules, .venv): mounted "
        "read-only into every job, never copied per job, never in the diff",
    )


class Declared(BaseModel):
    """An environment as a project declared it: the spec, where it was declared and what reading it
    had to say (a key ignored, a default taken)."""

    spec: EnvSpec
    source: str = Field(description="the declaration's path, relative to the project")
    form: Literal["devcontainer", "fila"]
    warnings: list[str] = Field(default_factory=list)
