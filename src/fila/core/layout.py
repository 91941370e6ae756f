"""Where things live under a queue root (docs/architecture.md, "On disk")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import FilaError, InvalidId
from .states import valid_id

# Between a task id and what else of the task a log file holds: never an id's character.
LOG_SEP = "~"


@dataclass(frozen=True)
class Root:
    path: Path

    @classmethod
    def at(cls, path: Path | str | None = None) -> Root:
        chosen = path or os.environ.get("FILA_ROOT") or os.getcwd()
        return cls(Path(chosen).resolve())

    # queue
    @property
    def fila(self) -> Path:
        return self.path / "fila"

    @property
    def in_dir(self) -> Path:
        return self.fila / "in"

    @property
    def run_dir(self) -> Path:
        """Claim files `<id>~<worker>.json`: a task here is owned by that worker (its lease)."""
        return self.fila / "run"

    @property
    def out_dir(self) -> Path:
        return self.fila / "out"

    @property
    def logs_dir(self) -> Path:
        return self.fila / "logs"

    @property
    def rejected_dir(self) -> Path:
        """Task files that did not validate, kept beside a `.reason` file, never deleted."""
        return self.fila / "rejected"

    @property
    def state_dir(self) -> Path:
        """Worker state (the circuit breaker)."""
        return self.fila / "state"

    # jobs
    @property
    def jobs_dir(self) -> Path:
        return self.path / "sandbox" / "jobs"

    @property
    def meta_dir(self) -> Path:
        """Host-only data per job (manifest, pending result, scratch): never mounted."""
        return self.path / "sandbox" / "meta"

    @property
    def spares_dir(self) -> Path:
        """Spare gateways' directories and the locks that say their worker lives (never mounted
        but into the spare itself: sandbox/gateways.py)."""
        return self.path / "sandbox" / "spares"

    @property
    def policies_dir(self) -> Path:
        return self.path / "policies"

    def all_dirs(self) -> list[Path]:
        return [
            self.in_dir,
            self.run_dir,
            self.out_dir,
            self.logs_dir,
            self.rejected_dir,
            self.state_dir,
            self.jobs_dir,
            self.meta_dir,
            self.policies_dir,
        ]

    def create(self) -> Root:
        """The queue layout (`fila init`): every directory, a .gitkeep where a project's git should
        keep the empty directory, and sandbox/ ignored by git. Safe to run again."""
        for d in self.all_dirs():
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.in_dir, self.out_dir, self.logs_dir):
            (d / ".gitkeep").touch()
        ignore = self.path / "sandbox" / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# job directories are large and disposable: fila gc removes them\n*\n")
        return self

    def job_dir(self, task_id: str) -> Path:
        return self.jobs_dir / check_id(task_id)

    def meta(self, task_id: str) -> Path:
        return self.meta_dir / check_id(task_id)

    def overlay_dir(self, task_id: str) -> Path:
        """An overlay job's upper layer (`upper/`) and the kernel's scratch for it (`work/`)."""
        return self.meta(task_id) / "overlay"

    def record_path(self, task_id: str) -> Path:
        return self.out_dir / f"{check_id(task_id)}.json"

    def queued_path(self, task_id: str) -> Path:
        return self.in_dir / f"{check_id(task_id)}.json"

    def log_path(self, task_id: str) -> Path:
        return self.logs_dir / f"{check_id(task_id)}.log"

    def events_path(self, task_id: str) -> Path:
        return self.logs_dir / f"{check_id(task_id)}.events.jsonl"

    def check_log_path(self, task_id: str) -> Path:
        """The task's check's log: `<id>~check.log` ('~' is no id's character, so no chosen id's
        own log is another task's check log, as `<id>.check.log` was for the id `<id>.check`)."""
        return self.logs_dir / f"{check_id(task_id)}{LOG_SEP}check.log"

    def kept_log_path(self, task_id: str, run: int, n: int, engine: str) -> Path:
        """The log of engine `n` of run `run` that fell back, kept aside: `<id>~<run>-<n>-<engine>.log`."""
        return self.logs_dir / f"{check_id(task_id)}{LOG_SEP}{run}-{n}-{engine}.log"

    def require(self) -> Root:
        if not self.in_dir.is_dir() or not self.out_dir.is_dir():
            raise FilaError(
                f"{self.path} is not a fila queue root (no fila/in, fila/out)",
                hint="run `fila init` there, or pass --root DIR / set FILA_ROOT",
            )
        dirs = (
            self.run_dir,
            self.rejected_dir,
            self.state_dir,
            self.meta_dir,
            self.jobs_dir,
            self.spares_dir,
        )
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        # Only the owner may reach job directories: during a run the engine's files are there
        # before the host has made them inert (handover.reclaim); a spare gateway's directory gets
        # a job's secrets.
        for d in (self.jobs_dir, self.meta_dir, self.spares_dir):
            if d.stat().st_mode & 0o077:
                d.chmod(0o700)
        return self


def check_id(task_id: str) -> str:
    if not valid_id(task_id):
        raise InvalidId(
            f"invalid task id {task_id!r}",
            hint="ids are 1-128 characters of A-Z a-z 0-9 . _ - (not '.' or '..')",
        )
    return task_id
