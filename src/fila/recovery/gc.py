"""`fila gc`: remove the job directories of decided tasks.

Only a task whose record says `applied` or `rejected` loses its `sandbox/jobs/<id>/` and
`sandbox/meta/<id>/`, and only once its decision is older than the given age: a job under review,
queued, running, failed or waiting for a person is never touched. The record and the logs stay
(`fila show` keeps working; `fila diff` and `fila review` then say the patch is gone).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..core import fsutil
from ..core.errors import FilaError, InvalidInput
from ..core.layout import Root
from ..core.models import Status
from ..queue import lease
from ..queue import store as queue

if TYPE_CHECKING:
    from ..sandbox.base import Runner

DECIDED = {Status.applied, Status.rejected}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Collected:
    id: str
    status: str
    decided_at: str
    paths: list[str]
    bytes: int


def parse_age(text: str) -> float:
    """'14d' -> seconds. Units: s, m, h, d."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhd])\s*", text)
    if not m:
        raise InvalidInput(f"not an age: {text!r}", hint="use a number and a unit: 30s, 15m, 12h, 14d")
    return int(m.group(1)) * _UNITS[m.group(2)]


def scratch_left(root: Root, tid: str) -> bool:
    """Whether the kernel's scratch of a rootless overlay (work/, index/ under the job's
    sandbox/meta/<id>/overlay/work) is left: a subordinate uid's, mode 000, only the backend can
    empty it (its worker was killed between its container's removal and the scratch's)."""
    scratch = root.meta(tid) / "overlay" / "work"
    return any(os.path.lexists(scratch / n) for n in ("work", "index"))


def clear_scratch(root: Root, tid: str, backend: Runner) -> bool:
    """Empty a job's leftover overlay scratch through the backend (`clear_job_scratch`, Podman's),
    never a live job's: under the job's lock (a worker runs its container under it, so no overlay
    is mounted on it meanwhile) and only while the task holds no claim file (recovery has reaped
    the stale ones; one still there is a live worker's). True when it was emptied; raises the
    backend's InfraError when it could not be."""
    with lease.try_job_lock(root, tid) as held:
        if not held or queue.claim_files(root, tid):
            return False
        return backend.clear_job_scratch(str(root.path), tid)


def collect(root: Root, older_than_s: float, *, dry_run: bool = False, now: datetime | None = None,
            backend: Runner | None = None) -> list[Collected]:  # fmt: skip
    """Remove (or, with dry_run, list) the job directories of tasks decided before now - age.
    `backend` empties a leftover rootless overlay scratch (the root's own when None, made only
    when one is there)."""
    root.require()
    now = now or datetime.now(UTC)
    out = []
    owned: list[Runner] = []
    try:
        for rec in queue.all_records(root):
            if rec.status not in DECIDED:
                continue
            at = rec.decision.at if rec.decision else rec.updated_at
            try:
                when = datetime.fromisoformat(at)
            except ValueError:
                continue
            if (now - when).total_seconds() < older_than_s:
                continue
            paths = [p for p in (root.job_dir(rec.id), root.meta(rec.id)) if os.path.lexists(p)]
            if not paths:
                continue
            size = sum(_size(p) for p in paths)
            if not dry_run:
                try:
                    if scratch_left(root, rec.id):
                        if backend is None:
                            from ..sandbox import get_backend, root_backend

                            backend = get_backend(root_backend(root))
                            owned.append(backend)
                        if clear_scratch(root, rec.id, backend):
                            queue.log_event(root, rec.id, "scratch cleared", by="gc")
                    for p in paths:
                        fsutil.remove_tree(p)
                except (FilaError, OSError, subprocess.CalledProcessError) as e:
                    # One job that cannot be removed must not keep the others from being collected.
                    queue.log_event(root, rec.id, "gc failed", error=str(e))
                    continue
                queue.log_event(root, rec.id, "job removed", by="gc", bytes=size)
            out.append(Collected(rec.id, rec.status, at, [str(p) for p in paths], size))
    finally:
        for b in owned:
            b.close()
    if not dry_run:
        # Snapshots go with the last job that links them (overlay strategy: sandbox/snapshots/).
        from ..workspace import snapshot_gc

        snapshot_gc.collect(root)
    return out


def _size(path: Path) -> int:
    """Disk use, counted iteratively: an engine's tree may be deeper than Python's recursion."""
    from ..workspace.handover import usage

    return usage(path, max_bytes=1 << 62, max_files=1 << 62)[0]
