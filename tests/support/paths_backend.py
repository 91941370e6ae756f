"""A fake container engine whose runs name the runner's local paths in what fila records, as real
ones do (Docker's output pump names its log, a gateway its directory, a FilaError its `path=`):
what a runner of the PostgreSQL queue must not publish (run/remote_publish.Redact)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fila.core.errors import InfraError
from fila.sandbox.base import RunResult, RunSpec
from fila.sandbox.fake import Act, FakeBackend


def lost_box(spec: RunSpec) -> Act | None:
    """Job `gone` loses its box once it started (needs_human, a diagnosis naming its log); job
    `back` fails before any box, its log named (handed back to the queue); every other job runs
    its command."""
    if spec.job_id == "gone":
        err = InfraError("the box went away", task_id=spec.job_id, path=spec.log_path)
        return Act(error=err, error_at="start")
    if spec.job_id == "back":
        return Act(error=InfraError("no box could be made", task_id=spec.job_id, path=spec.log_path))
    return None


class PathsBackend(FakeBackend):
    """The fake backend (script `lost_box`) whose every run that ends warns naming its log, its job
    directory and a directory of the runner's root `runner`."""

    def __init__(self, state: Path, runner: Path, script: Callable[[RunSpec], Act | None] = lost_box) -> None:
        super().__init__(state, script=script)
        self.runner = runner

    def run(self, spec: RunSpec, **kw: Any) -> RunResult:
        result = super().run(spec, **kw)
        result.warnings.append(
            f"output pump cut at {spec.log_path}; job in {spec.job_dir}/; gateway in {self.runner / 'fila'}"
        )
        return result
