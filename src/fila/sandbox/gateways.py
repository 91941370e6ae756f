"""Spare gateways: a worker keeps one started gateway per egress network its jobs use, so that a
`network: allowlist` job takes one that has already paid the proxy's start-up (most of a
gateway's cost: docs/benchmarks.md, "egress") instead of starting its own (docs/security.md,
"Spare gateways").

A spare has its own job network and directory and serves no one: it listens, refuses every
client and request, and holds no secret until a job takes it and the backend writes that job's
config (`configure`). It serves that one job and is removed after it, like a gateway made for the
job. What makes a spare the pool's is a lock file beside its directory, held while the process
that made it lives: recovery (`abandoned`) removes a spare, taken or not, only when nobody holds
its lock, so a worker killed with a spare up leaves nothing after `fila recover`.

The backend makes and removes the containers (`make`, `remove`); this module only decides when.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..core.fsutil import file_lock, held_new_lock, lock_held, private_dir
from ..core.text import inert
from ..egress.config import SPARE_LABEL, Gateway, remove_dir

# A spare's making is a second of the daemon's and the cores' time: started this long after the
# engine that took the last one (GatewayPool.replace).
REFILL_AFTER_S = 1.0

# make(spare id, egress network, directory, labels) -> a started spare; remove(gateway).
Make = Callable[[str, str, Path, dict[str, str]], Gateway]
Remove = Callable[[Gateway], None]
# A one-shot's reaper (sandbox/docker/reap.py) holds `reap-<token>.lock` in the spares directory
# while it works, and writes what it could not do to `reap-<token>.log` beside it (removed when
# it had nothing to say).
REAPER_LOCK = "reap-"
# handoff(gateways, directory) -> whether a detached remover took them (GatewayPool.close).
Handoff = Callable[[list[Gateway], Path], bool]


class GatewayPool:
    """One spare per egress network asked for (`want`), made in the background. `take` hands a
    spare over (waiting for one being made rather than making a second), `replace` starts the
    next (with `refill`), `discard` removes one a job has done with; `close` removes every spare
    not taken, also one still being made."""

    def __init__(
        self, make: Make, remove: Remove, directory: Path, labels: dict[str, str], *, refill: bool = True
    ) -> None:
        self._make, self._remove = make, remove
        self.directory, self.labels, self.refill = directory, labels, refill
        self._lock = threading.Lock()
        self._spares: dict[str, Future[Gateway]] = {}  # one per egress network, ready or being made
        self._closed = False
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fila-spare")
        self.errors: list[str] = []  # spares that could not be made or removed (said at close)
        self._discarding: list[tuple[threading.Thread, Gateway]] = []

    def want(self, network: str) -> None:
        """Start making a spare for `network` unless one is there or on its way."""
        with self._lock:
            if self._closed or network in self._spares:
                return
            self._spares[network] = self._workers.submit(self._new, network)

    def take(self, network: str) -> Gateway | None:
        """The spare for `network` (waited for while it is being made), or None: none was asked
        for, or making it failed (the job starts its own gateway, as without a pool)."""
        with self._lock:
            fut = None if self._closed else self._spares.pop(network, None)
        try:
            return fut.result() if fut is not None else None
        except Exception as e:
            self.errors.append(f"a spare gateway for {network} could not be made: {e}")
            return None

    def replace(self, network: str) -> None:
        """After a job took the spare of `network` (or found none), once its engine's container
        has started: the next spare is made (with `refill`) REFILL_AFTER_S later, while the
        engine runs (for minutes, as an AI engine does), not while the job's own container starts
        or a short job ends (the daemon and the cores are shared)."""
        if self.refill:
            timer = threading.Timer(REFILL_AFTER_S, self.want, (network,))
            timer.daemon = True
            timer.start()

    def discard(self, gw: Gateway) -> None:
        """Remove a gateway a job has done with, in the background: its process is dead and its
        secrets gone already (the job awaited that); its container and job network go here, then
        its lock. `close` waits for it; a process killed first leaves it to recovery (unowned)."""

        def remove() -> None:
            try:
                self._remove(gw)
            except Exception as e:
                self._failed(gw, e)

        t = threading.Thread(target=remove, name=f"fila-discard-{gw.spare}", daemon=True)
        with self._lock:
            closed = self._closed
            if not closed:
                self._discarding = [x for x in self._discarding if x[0].is_alive()] + [(t, gw)]
        if closed:  # `close` waits for no more: removed now (a job that outlived its worker's loop)
            remove()
            return
        t.start()

    def close(self, handoff: Handoff | None = None) -> list[str]:
        """Remove the spares not taken (after the ones being made are done) and wait for those
        being discarded; what could not be removed is returned, described, and left to `fila
        recover`. With `handoff` (a one-shot process about to exit), what is still to remove is
        given to it instead of waited for (the backend's detached reaper); when it cannot take
        them (False, or an error), they are removed here."""
        with self._lock:
            self._closed = True
            left, self._spares = list(self._spares.values()), {}
            discarding, self._discarding = self._discarding, []
        self._workers.shutdown(wait=True)
        made: list[Gateway] = []
        for fut in left:
            with contextlib.suppress(Exception):  # a spare never made has nothing to remove
                made.append(fut.result())
        errors = []
        pending = [gw for t, gw in discarding if t.is_alive()]
        if handoff is not None and (pending or made):
            try:
                if handoff(pending + made, self.directory):
                    return []
            except Exception as e:
                errors.append(f"the spare gateways could not be handed to a reaper ({e}): removed here")
        for t, _gw in discarding:
            t.join()
        for gw in made:
            try:
                self._remove(gw)
            except Exception as e:
                errors.append(self._failed(gw, e))
        return errors

    def _failed(self, gw: Gateway, err: Exception) -> str:
        """A spare that could not be removed is let go (its lock), so that recovery, this
        worker's own included, removes what is left by its labels; the error is kept for the
        worker to say."""
        what = f"spare gateway {gw.container}: {err}; `fila recover` removes it"
        self.errors.append(what)
        if gw.released is not None:
            gw.released()
        return what

    def _new(self, network: str) -> Gateway:
        sid = secrets.token_hex(6)
        # The spares directory gets jobs' secrets (InfraError: the job then starts a gateway of
        # its own).
        private_dir(self.directory, "spare gateway")
        # Locked before it has its name, and before anything of the spare exists: recovery never
        # sees the spare's lock free while its maker lives.
        released = held_new_lock(self.directory / f"{sid}.lock")
        try:
            gw = self._make(
                sid, network, self.directory / sid, {**self.labels, "fila": "1", SPARE_LABEL: sid}
            )
        except BaseException:
            released()  # make removed what it made, or said what is left: recovery finds it unowned
            raise
        gw.spare, gw.released = sid, released
        return gw


def owned(directory: Path, spare: str) -> bool:
    """Whether the process that made spare `spare` still holds it (its lock is held)."""
    return lock_held(directory / f"{spare}.lock")


def abandoned(directory: Path, listed: set[str]) -> set[str]:
    """The spares of `directory` nobody holds: those `listed` (found by the backend's labels) and
    those with only a directory or lock file left. The caller removes their containers and
    networks, then `forget`s each."""
    found = set(listed)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        found |= {p.name.removesuffix(".lock") for p in directory.iterdir()}
    return {s for s in found if _spare_id(s) and not owned(directory, s)}


def clear_temp(directory: Path) -> list[str]:
    """Lock files a killed maker left before naming them (`.<spare>.lock.tmp`), and those of
    reapers that died before they finished (`reap-<token>.lock`: sandbox/docker/reap.py, whose
    work recovery has just done): removed once nobody holds them."""
    gone = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for p in directory.iterdir():
            temp = p.name.startswith(".") and p.name.endswith(".lock.tmp")
            if not (temp or (p.name.startswith(REAPER_LOCK) and p.suffix == ".lock")):
                continue
            with contextlib.suppress(FileNotFoundError), file_lock(p, wait=False, create=False) as held:
                if held:
                    p.unlink()
                    gone.append(f"{'spare gateway' if temp else 'reaper'} lock {p}")
    return gone


def busy(directory: Path) -> list[Path]:
    """The locks of one-shots' reapers still at work in `directory` (held by a live process)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return [p for p in sorted(directory.glob(f"{REAPER_LOCK}*.lock")) if lock_held(p)]
    return []


def reapers_said(directory: Path, cap: int = 64 << 10) -> list[str]:
    """What one-shots' reapers that are done could not do (their `reap-<token>.log`: what they
    left, a traceback), for recovery to say; each log is removed once read (recovery has just
    swept what its reaper left)."""
    said: list[str] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for path in sorted(directory.glob(f"{REAPER_LOCK}*.log")):
            if lock_held(path.with_suffix(".lock")):
                continue  # still at work
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            except OSError as e:
                said.append(f"a one-shot's reaper log {path} could not be read: {e}")
                continue
            try:
                raw = os.read(fd, cap)
            finally:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            lines = [line.strip() for line in raw.decode("utf-8", "replace").splitlines() if line.strip()]
            said += [f"a one-shot's reaper said: {inert(line)}" for line in lines]
    return said


def forget(directory: Path, spare: str) -> None:
    """A spare's directory and lock file, once its containers and network are gone."""
    remove_dir(directory / spare)
    with contextlib.suppress(FileNotFoundError):
        (directory / f"{spare}.lock").unlink()


def _spare_id(name: str) -> bool:
    return len(name) == 12 and all(c in "0123456789abcdef" for c in name)
