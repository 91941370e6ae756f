"""Leases: who holds a claim, whether that worker is still alive, when a claim is stale.

A worker holds an exclusive flock on `fila/state/workers/<worker>.lock` for its whole life. The
kernel drops a flock when its process dies, however it dies (SIGKILL included), so on one host a
free lock proves the worker is gone; unlike a pid, a lock cannot be confused with a new process
that reused the number. Over NFS or from another host flock proves nothing: there only the
heartbeat counts. The heartbeat is the claim file's mtime, refreshed by the worker every
HEARTBEAT_S while it holds the claim.

A claim is stale when its worker is gone, or when its heartbeat is older than the lease TTL (a
frozen or partitioned worker). Reaping a stale claim of a worker that is merely slow is safe: its
next write is fenced (queue/store.py checks, under the record lock, that its claim file still exists),
so the late worker's result is ignored, as with fencing tokens. Its job directory is guarded by the
job lock (`job_lock`), which the job runner and recovery's reading of work/ both take.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from ..core.errors import InfraError, InvalidInput
from ..core.fsutil import file_lock
from ..core.layout import Root
from ..core.models import now_iso

HEARTBEAT_S = 2.0
LEASE_TTL_S = 60.0
Liveness = Literal["alive", "gone", "unknown"]
AliveFn = Callable[[str], Liveness]


def lease_ttl() -> float:
    """The lease TTL in seconds; FILA_LEASE_TTL overrides the default (ops and tests).

    A TTL shorter than a few heartbeats would reap live workers: refused, not clipped."""
    raw = os.environ.get("FILA_LEASE_TTL")
    if raw is None:
        return LEASE_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl >= 3 * HEARTBEAT_S:  # also refuses nan
        raise InvalidInput(
            f"FILA_LEASE_TTL={raw!r} is not a number of seconds of at least {3 * HEARTBEAT_S:g}",
            hint=f"unset it for the default ({LEASE_TTL_S:g} s)",
        )
    return ttl


def this_host() -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:40]


def host_of(worker: str) -> str | None:
    """Worker ids are `<host>-<pid>-<random>` (queue.new_worker_id)."""
    parts = worker.rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() else None


def workers_dir(root: Root) -> Path:
    return root.state_dir / "workers"


def lock_path(root: Root, worker: str) -> Path:
    return workers_dir(root) / f"{worker}.lock"


class WorkerLock:
    """Held for the lifetime of a worker process; a free lock means the worker is gone."""

    def __init__(self, root: Root, worker: str) -> None:
        self.path = lock_path(root, worker)
        self.fd: int | None = None

    def acquire(self) -> WorkerLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC: a child process (git, for the diff) must not inherit the lock and keep a
        # dead worker looking alive.
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # forget_dead_workers may have unlinked the file between our open and our flock (it
            # saw it unlocked): a lock on an unlinked inode would make us look dead. Check.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.write(fd, json.dumps({"pid": os.getpid(), "started_at": now_iso()}).encode())
                self.fd = fd
                return self
            os.close(fd)
        raise RuntimeError(f"could not take the worker lock {self.path}")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # unlinked while still locked: nobody can mistake it for alive
        os.close(self.fd)
        self.fd = None


# How long a job waits for its lock before it counts the holder as a stalled worker: recovery
# and gc hold it for a pass over one job directory (seconds), a stalled worker for good.
JOB_LOCK_WAIT_S = 15.0


@contextlib.contextmanager
def try_job_lock(root: Root, tid: str) -> Iterator[bool]:
    """The job lock if it is free now: yields True held, False when another process holds it."""
    meta = root.meta(tid)
    meta.mkdir(parents=True, exist_ok=True)
    with file_lock(meta / "job.lock", wait=False) as held:
        yield held


@contextlib.contextmanager
def job_lock(root: Root, tid: str, *, wait_s: float = 0.0) -> Iterator[None]:
    """One process at a time in sandbox/jobs/<id>/: a stalled worker whose lease was reaped must
    not have its job directory rebuilt under it by the next attempt, nor read by recovery while
    it writes, nor have its overlay scratch emptied. Waits up to `wait_s` for a holder that is
    only passing (recovery, gc), then InfraError."""
    deadline = time.monotonic() + wait_s
    while True:
        with try_job_lock(root, tid) as held:
            if held:
                yield
                return
        if time.monotonic() >= deadline:
            raise InfraError(
                "the job directory is still in use by another process (a stalled worker)", task_id=tid
            )
        time.sleep(0.1)


def worker_liveness(root: Root, worker: str) -> Liveness:
    """alive / gone on this host (by its lock); unknown for another host's worker."""
    if host_of(worker) != this_host():
        return "unknown"
    try:
        with file_lock(lock_path(root, worker), wait=False, create=False) as held:
            return "gone" if held else "alive"  # our probe lock, if we got it, drops here
    except FileNotFoundError:
        return "gone"


def forget_dead_workers(root: Root) -> list[str]:
    """Remove lock files of workers that are gone. Unlinked while we hold the lock, so a reader
    never sees a fresh, unlocked file of a live worker."""
    gone = []
    d = workers_dir(root)
    if not d.is_dir():
        return gone
    for p in d.glob("*.lock"):
        try:
            with file_lock(p, wait=False, create=False) as held:
                if held:  # unlinked while we hold it
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                    gone.append(p.stem)
        except FileNotFoundError:
            continue
    return gone


def live_workers(root: Root) -> list[str]:
    d = workers_dir(root)
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.lock") if worker_liveness(root, p.stem) != "gone")


def heartbeat_age(path: Path, now: float | None = None) -> float | None:
    try:
        # lstat: a claim may be a symlink dropped in fila/in/; its target's mtime is not the lease.
        return (now or time.time()) - path.lstat().st_mtime
    except FileNotFoundError:
        return None


def stale_reason(
    root: Root, path: Path, worker: str, *, ttl: float, alive: AliveFn | None = None, now: float | None = None
) -> str | None:
    """Why the claim at `path` is stale, or None while its lease holds."""
    state = (alive or (lambda w: worker_liveness(root, w)))(worker)
    if state == "gone":
        return f"worker {worker} is gone (its process ended)"
    age = heartbeat_age(path, now)
    if age is not None and age > ttl:
        return f"no heartbeat from worker {worker} for {age:.0f} s (lease TTL {ttl:g} s)"
    return None
