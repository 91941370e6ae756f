"""What a crashed worker leaves besides its claim: temp files of interrupted writes, containers,
volumes, job networks and gateway directories, overlay scratches of jobs no live worker holds
(docs/architecture.md, the queue's contract)."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import FilaError, InfraError
from ..core.layout import Root
from ..env.hold import build_alive
from ..queue import lease
from ..queue import store as queue
from ..sandbox.gateways import reapers_said
from .base import Engine, Report

if TYPE_CHECKING:
    from ..sandbox import Backend


def sweep_temp_files(root: Root, ttl: float, rep: Report) -> None:
    """Temp files of atomic writes whose writer died (a live writer renames within ms)."""
    now = time.time()
    dirs = [
        root.in_dir,
        root.out_dir,
        root.run_dir,
        root.state_dir,
        root.rejected_dir,
        lease.workers_dir(root),
    ]
    with (
        contextlib.suppress(FileNotFoundError, NotADirectoryError),
        os.scandir(root.meta_dir) as it,
    ):
        dirs += [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    for d in dirs:
        # One listing per directory (a glob per directory cost 30 ms over 1,000 jobs' meta).
        try:
            with os.scandir(d) as it:
                temps = [Path(e.path) for e in it if e.name.startswith(".") and e.name.endswith(".tmp")]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for p in temps:
            tid = _task_of_temp(p)
            # A record is only written under its record lock: holding it, any temp file of that
            # record is an interrupted write, however young. Elsewhere, age tells.
            held = queue.locked(root, tid) if tid and d == root.out_dir else None
            with (
                held or contextlib.nullcontext(),
                contextlib.suppress(FileNotFoundError),
            ):
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # fila's temp files are regular files: a directory or FIFO is not one
                if held is not None or now - st.st_mtime > ttl:
                    p.unlink()
                    rep.add(root, tid, "temp file removed", f"{p} (a write was interrupted)")


def _task_of_temp(p: Path) -> str | None:
    """`.<id>.json.<random>.tmp` (fsutil's names) -> id, when it names a task file or record."""
    parts = p.name[1:].split(".json.")
    return (
        parts[0] if len(parts) == 2 and queue.valid_id(parts[0]) and p.parent.name in ("in", "out") else None
    )


def sweep_containers(root: Root, dk: Engine, rep: Report) -> None:
    """Remove fila's containers of this root whose worker holds no claim of their task."""
    if not dk.enabled:
        return
    backend = dk.get()
    if backend is None:
        return
    from ..sandbox.base import JOB_LABEL, WORKER_LABEL

    try:
        found = backend.find(root=str(root.path))
    except InfraError as e:
        dk.error = f"listing containers failed: {e.message}"
        return
    for box in found:
        tid = box.labels.get(JOB_LABEL, "")
        # A claim outlives its container (the backend removes the container before the claim is
        # published or handed back), so a container listed before this check whose worker holds
        # no claim file of its task now is left over. A claim that is there, stale or not, is
        # never swept here: only the reaper, after winning the rename race (and with it the
        # right to decide), removes its container. Only that container goes, by id: a new
        # attempt's container of the same task is never touched.
        if not queue.valid_id(tid) or _has_claim(root, tid, box.labels.get(WORKER_LABEL)):
            continue
        try:
            removed = backend.remove(box)
        except InfraError as e:
            rep.add(root, tid, "error", f"could not remove container {box.name}: {e}")
            continue
        if removed:
            rep.containers_removed.append(box.id)
            rep.add(
                root,
                tid,
                "container removed",
                f"{box.name} ({box.status}): no live worker holds its task",
                container=box.name,
            )
    _sweep_egress(root, backend, rep)
    try:  # after the containers: a work volume goes only once no container uses it
        swept = backend.sweep_volumes(str(root.path))
    except InfraError as e:
        rep.add(root, None, "error", f"could not sweep fila's volumes: {e}")
        return
    for name, tid in swept:
        job = tid if tid is not None and queue.valid_id(tid) else None
        rep.add(
            root,
            job,
            "volume removed",
            f"{name}: no container used it (its removal was cut short)",
        )


def sweep_scratch(root: Root, dk: Engine, rep: Report) -> None:
    """Rootless overlay scratches of jobs no live worker holds: a worker killed between its
    container's removal and the scratch's leaves one with no container for the sweep above to
    find, and nothing else could remove it (gc's rm neither). After the claims are settled, a
    claim file still there is a live worker's: its scratch is kept (gc.clear_scratch)."""
    if not dk.enabled:
        return
    from .gc import clear_scratch, scratch_left

    try:
        names = sorted(os.listdir(root.meta_dir))
    except FileNotFoundError:
        return
    for tid in names:
        if not queue.valid_id(tid) or not scratch_left(root, tid):
            continue
        backend = dk.get()  # only when one is left: a recovery pass connects to nothing otherwise
        if backend is None:
            return
        try:
            cleared = clear_scratch(root, tid, backend)
        except (FilaError, OSError) as e:
            rep.add(root, tid, "error", f"could not clear the overlay scratch: {e}")
            continue
        if cleared:
            rep.add(
                root,
                tid,
                "scratch cleared",
                "the overlay scratch of a job no live worker holds",
            )


def _sweep_egress(root: Root, backend: Backend, rep: Report) -> None:
    """Job networks and gateway directories (secrets) of jobs no live worker holds: after the
    containers, so their gateways are gone and the networks can be removed. Then spare gateways
    (taken by a job or not) whose worker is gone."""
    try:
        removed = backend.sweep_egress(
            root.path, root.meta_dir, lambda tid, worker: _has_claim(root, tid, worker)
        )
    except (InfraError, OSError) as e:
        rep.add(
            root,
            None,
            "error",
            f"could not sweep job networks or gateway directories: {e}",
        )
        return
    for what in removed:
        rep.add(root, None, "egress removed", f"{what}: no live worker holds its task")
    try:
        spares = backend.sweep_spares(root.path, root.spares_dir)
    except (InfraError, OSError) as e:
        rep.add(root, None, "error", f"could not sweep spare gateways: {e}")
        return
    for what in spares:
        rep.add(root, None, "egress removed", f"{what}: the worker that kept it is gone")
    # What one-shots' reapers could not do (sandbox/docker/reap.py), now that what they left is
    # swept: said once, their logs removed.
    for what in reapers_said(root.spares_dir):
        rep.add(root, None, "reaper said", what)


def _has_claim(root: Root, tid: str, worker: str | None) -> bool:
    """Any claim or tombstone (.json, .done, .reaped) of the task, of `worker` when known; or
    `tid` is a `fila env build`'s whose process lives (its hold: env/hold.py)."""
    if build_alive(root, tid):
        return True
    for p in queue.claim_files(root, tid):
        parsed = queue.parse_claim(p)
        if parsed is None or worker is None or parsed[0].worker == worker:
            return True
    return False
