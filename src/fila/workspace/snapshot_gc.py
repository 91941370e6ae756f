"""Collection of the snapshot store (workspace/snapshot.py, docs/architecture.md): the snapshots
no job links to any more, and the builds a crash left behind.

It shares only the store's path and its lock with the rest of the store: under that lock a
snapshot is either linked to a job (`snapshot.take`) or renamed out of reach here, never both.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..core import fsutil
from ..core.layout import Root
from .snapshot import locked, store


@dataclass
class Collected:
    key: str
    bytes: int


def collect(root: Root, *, dry_run: bool = False, stale_s: float = 86400) -> list[Collected]:
    """Remove the snapshots no job links to any more (their manifest has one link), and builds a
    crash left behind (`.new-*` older than `stale_s`). Runs after gc has removed decided jobs."""
    from .handover import usage

    d = store(root)
    if not d.is_dir():
        return []
    out: list[Collected] = []
    doomed: list[Path] = []
    with locked(root):
        for entry in os.scandir(d):
            p = Path(entry.path)
            if entry.name.startswith(".new-"):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > stale_s:
                    doomed.append(p)
                continue
            if len(entry.name) != 64 or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                links = os.lstat(p / "manifest.json").st_nlink
            except FileNotFoundError:
                links = 1
            if links <= 1:
                doomed.append(p)
        for p in doomed:
            size = usage(p, max_bytes=1 << 62, max_files=1 << 62)[0]
            if not dry_run:
                gone = d / f".gone-{p.name}"
                os.rename(p, gone)  # out of a job's reach (snapshot.take) before the lock is let go
                p = gone
            out.append(Collected(p.name.removeprefix(".gone-"), size))
    if not dry_run:
        for p in d.glob(".gone-*"):
            fsutil.remove_tree(p)
    return out
