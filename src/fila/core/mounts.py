"""The Workspace seam: what a job's container sees where, and how its files are handed over and
back (docs/architecture.md, "The Workspace seam").

The cycle chooses a strategy (workspace/strategy.py: the copy, or an overlay of a shared
snapshot) and passes it in the RunSpec; a backend asks it for the mounts, for the disk the engine
has used so far, and to hand work/ to the engine's uid and back. So no backend knows how a job
directory is made, and the strategies know no container engine: both sides share only these
types, which is why they live in the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Bind:
    """A host directory at `target` in the container."""

    target: str
    source: Path
    read_only: bool


@dataclass(frozen=True)
class OverlayVolume:
    """An overlay the container engine mounts at `target`: `lower` read-only (shared by jobs),
    every write lands in `upper`, and `scratch` is the kernel's own working directory (its
    `workdir`). Both of the latter are host-only (under the job's meta directory)."""

    target: str
    lower: Path
    upper: Path
    scratch: Path

    def options(self) -> str:
        """The overlay mount options. `userxattr`: the opaque-directory marks are user.* xattrs
        the host reads without privilege (redirect_dir and metacopy stay off with it, so a
        renamed directory is copied and every changed file is whole in the upper layer)."""
        return f"lowerdir={self.lower},upperdir={self.upper},workdir={self.scratch},userxattr"


Mount = Bind | OverlayVolume


@dataclass(frozen=True)
class ProvidedVolume:
    """A directory an environment's setup made in the project tree (node_modules, .venv), kept
    in a volume of the container engine filled once per environment and mounted read-only at
    `target` in every job of it: never copied per job, never written by an engine
    (docs/environments.md, "Provided paths")."""

    target: str
    name: str


@runtime_checkable
class Workspace(Protocol):
    """One job's input/ and work/ as a backend mounts, watches and hands back. The job directory
    (TASK.md, input/ and work/ as mount points or copies) is `job_dir`; it is mounted read-only,
    so only work/ takes the engine's writes."""

    @property
    def job_dir(self) -> Path: ...

    def mounts(self, target: str) -> list[Mount]:
        """What the container sees under `target` (the job mount): the job directory read-only,
        input/ read-only and work/ writable, in mount order."""
        ...

    def usage(self, *, max_bytes: int, max_files: int) -> tuple[int, int]:
        """Disk bytes and entries the job holds while the engine runs (counting stops past
        either limit): no mount has a quota of its own."""
        ...

    def hand_over(self, uid: int, gid: int) -> None:
        """Give work/ to the engine's uid (fila runs as root; the engine must not)."""
        ...

    def reclaim(self, owner: tuple[int, int] | None) -> list[str]:
        """After the container is gone: make what the engine left inert, and work/ the host
        user's again (`owner`: the host's uid and gid when the engine ran as another). Returns
        warnings for the record."""
        ...


def overlay_of(workspace: Workspace, target: str) -> OverlayVolume | None:
    """The workspace's overlay volume (the overlay strategy's work/), if it has one."""
    return next((m for m in workspace.mounts(target) if isinstance(m, OverlayVolume)), None)
