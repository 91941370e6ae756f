"""Recovery (`fila recover`, and in the background of every worker): after a crash, every task
ends in exactly one state, nothing is lost, nothing runs twice without a person deciding.

What it settles, each step an event in the task's log (and in fila/state/recovery.events.jsonl):
- a stale claim (its worker is gone, or its heartbeat is older than the lease TTL): reaped by
  renaming it to `.reaped` (the race with the worker's `.done`), then
  - container not started: back to fila/in/ (attempt counted; failed once the retry policy of
    queue/retry.py gives up),
  - container started: the container is removed, then `needs_human`, with a diagnosis (worker,
    how long it ran, the container as found, what work/ holds, kept as DIFF.patch evidence). Only
    once Docker confirmed no container of the job is left: until then (Docker down, removal
    failed, `--no-docker`) the `.reaped` tombstone stays and a later pass decides, because a
    frozen worker could still start the engine after a person's decision,
  - never begun (record still queued, or a dropped file without a record): back to fila/in/,
  - the record is another claim's or final: the file is a duplicate, kept in fila/rejected/;
- a `.done` tombstone of a dead worker: its outcome is published from result.json;
- a `.reaped` tombstone (a recovery was killed): settled as above;
- a queued record without its file (submit or retry killed between its writes): file rewritten;
- a running record without any claim: requeued (file back from the record) or needs_human
  (after its container is confirmed gone);
- a record whose status differs from the last status change in its log (a crash between the
  record write and its event): an `event lost` event with `from`/`to`;
- a file in fila/in/ whose record is running without a claim: the hand back is completed;
- a file in fila/in/ for a task that is already past queued: a duplicate, kept in fila/rejected/;
- temp files of atomic writes older than the lease TTL;
- fila's containers of this root whose worker holds no claim file of their task: removed;
- a rootless overlay scratch left in sandbox/meta/<id>/ of a task with no claim: emptied (backend);
- on a root marked as a PostgreSQL runner's, the job roots (`remote/<id>.<token>`) whose lock file
  nobody holds and whose mark is their lock's: each recovered as a root of its own (its claim's
  worker counts as gone; never waiting for its recovery lock), its containers, gateway and
  networks removed, then the job root (`recover_job_roots`, remote_jobs.py says who may remove a
  job root and when); what a runner did not make is left and said. The queue database decides
  their tasks, by their leases.

One recovery at a time per root (a flock); it is safe while workers run.

This module is the pass and its order; the steps live by role: `claims` (stale claims and
tombstones), `records` (each record against its files and log), `settled` (what a pass may skip),
`sweep` (temp files, containers, networks, scratches), with the report and the container engine
they share in `base` (docs/architecture.md, layers).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..core import fsutil
from ..core.errors import FilaError, InfraError
from ..core.layout import Root
from ..queue import lease
from ..queue import store as queue
from . import remote_jobs, runner_root
from .base import Engine, Report
from .claims import settle_claim
from .records import settle_task
from .settled import Settled
from .sweep import sweep_containers, sweep_scratch, sweep_temp_files

if TYPE_CHECKING:
    from ..sandbox import Backend


@contextlib.contextmanager
def _recovery_lock(root: Root, wait: bool, wait_s: float | None = None) -> Iterator[bool]:
    """The root's recovery lock (fila/state/.recovery.lock) for the block: True when held, False
    at once when another holds it and `wait` is False. `wait_s`: wait at most that long, then
    InfraError naming the lock (a runner's start says so rather than hangs). On a PostgreSQL
    runner's root (runner_root.marked) the lock must be a regular file of this user's: one another
    user planted, and holds, would stop every recovery of the root (InfraError saying so)."""
    root.state_dir.mkdir(parents=True, exist_ok=True)
    path = root.state_dir / ".recovery.lock"
    held = contextlib.ExitStack()
    try:  # only the lock's own errors here: the block's are the caller's
        got = held.enter_context(
            fsutil.file_lock(path, wait=wait, wait_s=wait_s, own=runner_root.marked(root), mode=0o600)
        )
    except PermissionError as e:
        raise InfraError(
            f"{e}: a lock another user holds would stop every recovery of this runner's root",
            hint=f"remove {path} (fila makes it again) and `chmod go-w {root.state_dir}`",
        ) from None
    except TimeoutError:
        raise InfraError(
            f"another recovery holds {path} (waited {wait_s:g} s)",
            hint="let it finish (`fila recover --root` may be running), or find who holds it: "
            f"`fuser {path}`",
        ) from None
    with held:
        yield got


def recover(
    root: Root,
    *,
    backend: Backend | None = None,
    docker: bool = True,
    ttl: float | None = None,
    alive: lease.AliveFn | None = None,
    wait: bool = True,
) -> Report:
    """One recovery pass over the root. `alive` replaces the worker liveness probe (tests)."""
    root.require()
    ttl = lease.lease_ttl() if ttl is None else ttl
    rep = Report()
    with _recovery_lock(root, wait) as got:
        if not got:
            rep.skipped = True
            return rep
        dk = Engine(root, backend, docker)
        for claim, suffix in queue.claims(root):
            try:
                settle_claim(root, claim, suffix, ttl, alive, dk, rep)
            except (
                FilaError,
                OSError,
                ValueError,
            ) as e:  # one task must not stop the others
                rep.add(root, claim.task_id, "error", f"could not settle {claim.name}: {e}")
        settled = Settled.load(root, rep)
        records = _record_ids(root)
        queued = {p.stem for p in queue.queued_files(root) if queue.valid_id(p.stem)}
        claimed = {c.task_id for c, _suffix in queue.claims(root)}
        now = time.time()
        for tid in sorted(records | queued):
            try:
                if settled.unchanged(tid, queued=tid in queued, claimed=tid in claimed, now=now):
                    continue
                settle_task(root, tid, dk, rep, settled, listed=tid in records)
            except (FilaError, OSError, ValueError) as e:
                rep.add(root, tid, "error", f"could not settle: {e}")
        settled.save(root, records)
        sweep_temp_files(root, ttl, rep)
        _setup_gateways(root, rep)
        sweep_containers(root, dk, rep)
        sweep_scratch(root, dk, rep)
        _job_roots(root, dk, rep)
        lease.forget_dead_workers(root)
        _engine_used(dk, rep)
    return rep


def _setup_gateways(root: Root, rep: Report) -> None:
    """A dead setup's gateway directory holds its routes' secrets (docs/environments.md)."""
    from ..env.build import sweep_setup_gateways

    for gw in sweep_setup_gateways(root):
        rep.add(root, None, "setup gateway directory removed", gw)


def _record_ids(root: Root) -> set[str]:
    """The ids of the records in fila/out/, by name (one directory listing, nothing read)."""
    with os.scandir(root.out_dir) as it:
        names = [e.name for e in it if e.name.endswith(".json") and not e.name.startswith(".")]
    return {n[: -len(".json")] for n in names if queue.valid_id(n[: -len(".json")])}


def recover_job_roots(
    root: Root, *, backend: Backend | None = None, wait: bool = True, wait_s: float | None = None
) -> Report:
    """Only the job roots of a PostgreSQL runner's root that nobody holds (a runner's start:
    those of an earlier runner process on this root that died with its jobs), under the root's
    recovery lock (`wait_s`: waited for at most that long, then InfraError naming it; see
    `_recovery_lock`); see `_job_roots`."""
    rep = Report()
    with _recovery_lock(root, wait, wait_s) as got:
        if not got:
            rep.skipped = True
            return rep
        dk = Engine(root, backend, True)
        _job_roots(root, dk, rep)
        _engine_used(dk, rep)
    return rep


def _engine_used(dk: Engine, rep: Report) -> None:
    """What the pass asked of the container engine, in the report; its connection closed."""
    rep.docker = dk.error or ("ok" if dk.used else "not needed")
    rep.backend = dk.backend.name if dk.used and dk.backend is not None else ""
    dk.close()


def _job_roots(root: Root, dk: Engine, rep: Report) -> None:
    """Each job root under `root/remote/` whose lock is free (its runner is gone), on a root marked
    as a PostgreSQL runner's only: recovered as a queue root of its own with its claim's worker
    counted gone (its containers and gateway stopped and removed, its job networks and
    directories), then removed once the container engine confirms that no container of it is
    left and its recovery had no error (`remote_jobs.remove`; the rest of a removal stopped
    part-way, `.<name>.removing`, is finished). Held locks are never touched; nor what the runner did not
    make (a directory without its lock file, a link, a job root whose mark is not its lock's: kept
    and said); without the container engine (`--no-docker`, or it does not answer) a job root is
    kept for a later pass. Nothing is decided in the queue database: the claim's lease does
    (docs/scale-out.md)."""
    if not runner_root.marked(root):
        return
    notes: list[str] = []
    for name in remote_jobs.names(root, notes):
        try:
            with remote_jobs.free(root, name) as nonce:
                if nonce is not None:
                    _job_root(root, name, nonce, dk, rep)
        except (FilaError, OSError, ValueError) as e:  # one job root must not stop the others
            path = runner_root.jobs_dir(root) / name
            rep.add(root, None, "job root kept", f"{path}: could not be recovered: {e}")
    for note in notes:
        rep.add(root, None, "job root kept", note)


def _job_root(root: Root, name: str, nonce: str, dk: Engine, rep: Report) -> None:
    path = runner_root.jobs_dir(root) / name
    if remote_jobs.finish_removal(path):  # a removal (its runner's or a recovery's) stopped part-way
        rep.add(root, None, "job root removed", f"{path}: the rest of a removal that was stopped part-way")
    if not (path.exists() or path.is_symlink()):  # its runner died before making it, or removed it
        remote_jobs.forget(root, name)
        return
    if not remote_jobs.proven(path, nonce):
        if remote_jobs.clear_unmade(path, nonce):  # its runner died while making it: nothing in it yet
            remote_jobs.forget(root, name)
            rep.add(root, None, "job root removed", f"{path}: its runner died while making it")
            return
        rep.add(root, None, "job root kept", f"{path}: not the job root its lock's runner made (a "
                "link, another user's, or its mark is not the lock's): left as it is; "
                "docs/scale-out.md says how to remove one by hand")  # fmt: skip
        return
    if not dk.enabled:
        rep.add(root, None, "job root kept", f"{path}: its containers cannot be checked (--no-docker)")
        return
    backend = dk.get()
    if backend is None:
        engine = dk.backend.name if dk.backend is not None else "container"
        rep.add(root, None, "job root kept", f"{path}: the {engine} engine does not answer ({dk.error})")
        return
    jr = Root(path)
    removed: list[str] = []
    failed: list[str] = []
    if jr.in_dir.is_dir() and jr.out_dir.is_dir():  # else made only in part: no container ran there
        # Never blocks (a recovery of the job root already running: a later pass decides it).
        sub = recover(jr, backend=backend, alive=lambda _w: "gone", wait=False)
        removed = sub.containers_removed
        rep.containers_removed += removed
        failed = [a.detail for a in sub.actions if a.action == "error"]
        if sub.skipped:
            failed.append("another recovery of it is running")
    left = backend.find(root=str(path))
    if left or failed:
        what = f"{len(left)} of its containers are still there" if left else failed[0]
        rep.add(root, None, "job root kept", f"{path}: {what}; a later recovery tries again")
        return
    remote_jobs.remove(path)
    rep.add(root, None, "job root removed", f"{path}: its runner is gone; {len(removed)} containers "
            "removed; the queue database decides its task by its lease")  # fmt: skip
    remote_jobs.forget(root, name)
