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

from . import fsutil, queue
from .errors import InvalidInput
from .layout import Root
from .models import Status

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


def collect(root: Root, older_than_s: float, *, dry_run: bool = False,
            now: datetime | None = None) -> list[Collected]:  # fmt: skip
    """Remove (or, with dry_run, list) the job directories of tasks decided before now - age."""
    root.require()
    now = now or datetime.now(UTC)
    out = []
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
                for p in paths:
                    fsutil.remove_tree(p)
            except (OSError, subprocess.CalledProcessError) as e:
                # One job that cannot be removed must not keep the others from being collected.
                queue.log_event(root, rec.id, "gc failed", error=str(e))
                continue
            queue.log_event(root, rec.id, "job removed", by="gc", bytes=size)
        out.append(Collected(rec.id, rec.status, at, [str(p) for p in paths], size))
    if not dry_run:
        # Snapshots go with the last job that links them (overlay strategy: sandbox/snapshots/).
        from . import snapshot

        snapshot.collect(root)
    return out


def _size(path: Path) -> int:
    """Disk use, counted iteratively: an engine's tree may be deeper than Python's recursion."""
    from .jobdir import usage

    return usage(path, max_bytes=1 << 62, max_files=1 << 62)[0]
