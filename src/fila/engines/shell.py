"""The shell engine: the task's `command` run by `sh -c` in work/. For mechanical changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Task
from .base import JOB_MOUNT, Engine, Invocation, Outcome, RunOutput


class ShellConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: str = Field(min_length=1)


class ShellEngine(Engine):
    name = "shell"
    Config = ShellConfig
    any_route = True  # the command is the task author's: it may curl any route the policy gives

    def invocation(self, task: Task) -> Invocation:
        cfg = self.config(task)
        assert isinstance(cfg, ShellConfig)
        # The command is passed as $1, never spliced into the script, so no quoting can break out.
        script = f'cd {JOB_MOUNT}/work || exit 97; exec /bin/sh -c "$1"'
        return Invocation(
            argv=["/bin/sh", "-c", script, "fila-shell", cfg.command],
            env=self.base_env(),
        )

    def classify(self, exit_code: int | None, output: RunOutput) -> Outcome:
        # A shell command's output is the user's own text: "429" in it is not a quota signal.
        if exit_code != 0:
            return Outcome("engine_error", f"command exited with code {exit_code}")
        return Outcome("success")
