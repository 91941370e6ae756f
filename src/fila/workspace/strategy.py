"""The two ways a job's input/ and work/ are made, as the Workspace seam a backend sees
(core/mounts.py; docs/architecture.md, "The Workspace seam").

- The copy (`CopyWorkspace`, on the job directory jobdir.prepare makes): input/ and work/ are the
  job's own copies, bind-mounted; the diff compares the two trees.
- The overlay (`OverlayWorkspace`, on what overlay.prepare_job makes): input/ is a shared snapshot's
  tree, and work/ an overlay of it whose upper layer, under the job's meta directory, takes every
  write; the diff reads that layer (`layers`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from ..core.mounts import Bind, Mount
from . import handover
from .overlay import Layers, Overlay


class JobWorkspace(ABC):
    """A job directory and how its work/ is mounted; what both strategies share."""

    strategy: str

    def __init__(self, job_dir: Path) -> None:
        self._job_dir = job_dir

    @property
    def job_dir(self) -> Path:
        return self._job_dir

    @abstractmethod
    def mounts(self, target: str) -> list[Mount]: ...

    @abstractmethod
    def layers(self) -> Layers | None:
        """What the diff reads for work/: the overlay's layers, or None for the job's own copies."""

    def usage(self, *, max_bytes: int, max_files: int) -> tuple[int, int]:
        return handover.usage(self._job_dir, max_bytes=max_bytes, max_files=max_files)

    def hand_over(self, uid: int, gid: int) -> None:
        handover.hand_over(self._job_dir, uid, gid)

    def reclaim(self, owner: tuple[int, int] | None) -> list[str]:
        return handover.reclaim(self._job_dir, owner=owner)


class CopyWorkspace(JobWorkspace):
    """input/ and work/ copied into the job directory."""

    strategy = "copy"

    def mounts(self, target: str) -> list[Mount]:
        job = self.job_dir.resolve()
        return [
            Bind(target, job, read_only=True),
            Bind(f"{target}/input", job / "input", read_only=True),
            Bind(f"{target}/work", job / "work", read_only=False),
        ]

    def layers(self) -> None:
        return None


class OverlayWorkspace(JobWorkspace):
    """input/ the shared snapshot, work/ an overlay of it: the job directory holds TASK.md and the
    two mount points, the upper layer and the overlay's scratch are in the job's meta directory."""

    strategy = "overlay"

    def __init__(self, job_dir: Path, overlay: Overlay) -> None:
        super().__init__(job_dir)
        self.overlay = overlay

    def mounts(self, target: str) -> list[Mount]:
        ov = self.overlay
        return [
            Bind(target, self.job_dir.resolve(), read_only=True),
            Bind(f"{target}/input", ov.lower, read_only=True),
            ov.volume(f"{target}/work"),
        ]

    def usage(self, *, max_bytes: int, max_files: int) -> tuple[int, int]:
        """The job directory and the upper layer, where what the engine writes lands."""
        used, files = super().usage(max_bytes=max_bytes, max_files=max_files)
        more = handover.usage(self.overlay.upper, max_bytes=max_bytes - used, max_files=max_files - files)
        return used + more[0], files + more[1]

    def reclaim(self, owner: tuple[int, int] | None) -> list[str]:
        return super().reclaim(owner) + handover.reclaim_tree(self.overlay.upper, owner=owner)

    def layers(self) -> Layers:
        return self.overlay.layers()
