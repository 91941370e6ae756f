"""Holds: what keeps a setup's or a Dockerfile build's leftovers from the sweeps while its process
lives, and hands them to the sweeps once it is gone (docs/environments.md, "Secrets for the setup").

A hold is a lock file `sandbox/envs/held/<id>.lock`, held from its first moment by the process
that made it, and a directory `held/<id>/` beside it for the gateways' states (their routes'
secrets). `fila env build` runs no task, so no claim keeps its containers and networks: it labels
them with the job id `env-build-<id>` of its hold, which recovery takes as alive while the lock
is held (`build_alive`). `sweep` removes every hold's directory and lock that no process holds,
whoever made it: by its lock, never by an id.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core import fsutil
from ..core.layout import Root

BUILD_PREFIX = "env-build-"
_ID = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class Hold:
    ident: str
    dir: Path  # the gateways' states of what this hold covers

    @property
    def job_id(self) -> str:
        """The job id of the containers and networks of a build no task claims (`fila env build`)."""
        return BUILD_PREFIX + self.ident


def holds_dir(root: Root) -> Path:
    return root.path / "sandbox" / "envs" / "held"


@contextlib.contextmanager
def hold(root: Root) -> Iterator[Hold]:
    """A new hold for the block: its lock held before anything of it exists, its directory (0700)
    and then its lock removed after the block, however it ends."""
    base = holds_dir(root)
    fsutil.private_dir(base, "build gateway's secret")
    ident = secrets.token_hex(6)
    release = fsutil.held_new_lock(base / f"{ident}.lock")
    try:
        (base / ident).mkdir(mode=0o700)
        yield Hold(ident, base / ident)
    finally:
        try:
            fsutil.remove_tree(base / ident)
        finally:
            release()


def build_alive(root: Root, job_id: str) -> bool:
    """Whether `job_id` is a hold's build id (`env-build-<id>`) whose process still holds it."""
    ident = job_id.removeprefix(BUILD_PREFIX)
    if ident == job_id or not _ID.fullmatch(ident):
        return False
    return fsutil.lock_held(holds_dir(root) / f"{ident}.lock")


def sweep(root: Root) -> list[str]:
    """The holds no live process holds: their directories (a killed setup's or build's gateway
    state, its routes' secrets among it) and lock files, and lock files a process killed before
    naming them left (`.<id>.lock.tmp`). Returns what was removed."""
    base = holds_dir(root)
    try:
        names = sorted(p.name for p in base.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        p = base / name
        if name.startswith(".") and name.endswith(".lock.tmp") and _ID.fullmatch(name[1:-9]):
            if not fsutil.lock_held(p):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(str(p))
            continue
        ident = name.removesuffix(".lock")
        if not _ID.fullmatch(ident) or fsutil.lock_held(base / f"{ident}.lock"):
            continue
        if name == ident:
            fsutil.remove_tree(p)
            removed.append(str(p))
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return removed
