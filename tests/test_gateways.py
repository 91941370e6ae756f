"""The pool of spare gateways (sandbox/gateways.py) without a container engine: when spares are
made, handed over, replaced and removed, and how recovery tells a spare whose worker lives from
one a killed worker left. The containers themselves: test_egress (Docker), test_podman_egress."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fila.egress.config import SPARE_LABEL, Gateway
from fila.sandbox.gateways import GatewayPool, abandoned, forget, owned


class Engine:
    """make/remove for the pool, recording what it did; `block` holds a make until set, `fail`
    makes the next make raise (as a daemon that refuses)."""

    def __init__(self) -> None:
        self.made: list[Gateway] = []
        self.removed: list[str] = []
        self.block = threading.Event()
        self.block.set()
        self.fail: str | None = None

    def make(self, spare: str, network: str, state: Path, labels: dict[str, str]) -> Gateway:
        self.block.wait(10)
        if self.fail:
            raise RuntimeError(self.fail)
        assert labels[SPARE_LABEL] == spare and labels["fila"] == "1"
        state.mkdir(parents=True)
        gw = Gateway("", f"net-{spare}", f"gw-{spare}", "", state, [])
        self.made.append(gw)
        return gw

    def remove(self, gw: Gateway) -> None:
        if self.fail:
            raise RuntimeError(self.fail)
        self.removed.append(gw.container)
        if gw.released is not None:
            gw.released()


@pytest.fixture
def engine() -> Engine:
    return Engine()


def pool_of(engine: Engine, tmp_path: Path, *, refill: bool = True) -> GatewayPool:
    return GatewayPool(
        engine.make, engine.remove, tmp_path / "spares", {"fila.root": str(tmp_path)}, refill=refill
    )


def test_a_job_takes_the_spare_being_made_and_the_next_is_made_only_once_its_engine_runs(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fila.sandbox.gateways.REFILL_AFTER_S", 0.0)
    pool = pool_of(engine, tmp_path)
    assert pool.take("egress") is None  # none asked for: the job starts its own
    engine.block.clear()
    pool.want("egress")
    pool.want("egress")  # asked twice while being made: one spare
    got: list[Gateway | None] = []
    taker = threading.Thread(target=lambda: got.append(pool.take("egress")))
    taker.start()
    time.sleep(0.2)
    assert taker.is_alive() and got == []  # waits for the one being made, never makes a second
    engine.block.set()
    taker.join(10)
    (gw,) = got
    assert gw is not None and gw.spare is not None and len(engine.made) == 1
    assert owned(pool.directory, gw.spare)  # its lock held while this process lives
    assert pool.take("egress") is None  # taken: nothing until it is replaced
    pool.replace("egress")
    deadline = time.monotonic() + 10
    while len(engine.made) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.made) == 2
    pool.discard(gw)
    assert pool.close() == [] and pool.errors == []
    # Closed: the discarded one and the untaken one are removed, their locks let go.
    assert sorted(engine.removed) == sorted(g.container for g in engine.made)
    assert not any(owned(pool.directory, g.spare or "") for g in engine.made)
    assert abandoned(pool.directory, set()) == {g.spare for g in engine.made}  # dirs left to forget


def test_a_spare_that_cannot_be_made_leaves_the_job_to_start_its_own_and_nothing_behind(
    engine: Engine, tmp_path: Path
) -> None:
    pool = pool_of(engine, tmp_path, refill=False)
    engine.fail = "the daemon refused"
    pool.want("egress")
    assert pool.take("egress") is None
    assert pool.errors and "the daemon refused" in pool.errors[0]
    assert pool.close() == []
    assert list((tmp_path / "spares").iterdir()) == []  # no lock left behind
    engine.fail = None
    pool = pool_of(engine, tmp_path, refill=False)  # the allowed counterpart: it is made
    pool.want("egress")
    assert pool.take("egress") is not None and pool.close() == []


def test_recovery_removes_only_spares_whose_worker_is_gone(engine: Engine, tmp_path: Path) -> None:
    """A live process's spare is kept (its lock is held, also when probed from this process);
    a spare whose process was SIGKILLed is abandoned and forgotten (directory and lock)."""
    pool = pool_of(engine, tmp_path, refill=False)
    pool.want("egress")
    mine = pool.take("egress")
    assert mine is not None and mine.spare is not None
    spares = pool.directory
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(spares)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    theirs = child.stdout.readline().strip()
    assert owned(spares, theirs)  # the other process lives: kept
    assert abandoned(spares, {mine.spare, theirs}) == set()
    child.kill()
    child.wait()
    assert abandoned(spares, {mine.spare, theirs, "0123456789ab"}) == {theirs, "0123456789ab"}
    forget(spares, theirs)
    assert not (spares / theirs).exists() and not (spares / f"{theirs}.lock").exists()
    assert owned(spares, mine.spare)
    pool.discard(mine)
    assert pool.close() == []


def test_a_spare_that_cannot_be_removed_is_let_go_for_recovery_and_a_planted_link_is_refused(
    engine: Engine, tmp_path: Path
) -> None:
    pool = pool_of(engine, tmp_path)
    pool.want("egress")
    gw = pool.take("egress")
    assert gw is not None and gw.spare is not None and owned(pool.directory, gw.spare)
    engine.fail = "the daemon refused to remove it"
    pool.discard(gw)
    assert pool.close() == []
    # Not removed, but no longer held: recovery (this worker's own included) removes the rest.
    assert not owned(pool.directory, gw.spare) and gw.spare in abandoned(pool.directory, {gw.spare})
    assert any("the daemon refused to remove it" in e for e in pool.errors), pool.errors
    # The spares directory gets jobs' secrets: a link planted in its place is refused.
    engine.fail = None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    (tmp_path / "planted").symlink_to(elsewhere)
    pool = GatewayPool(engine.make, engine.remove, tmp_path / "planted", {}, refill=False)
    pool.want("egress")
    assert pool.take("egress") is None and "is not a directory of this user's" in pool.errors[0]
    assert list(elsewhere.iterdir()) == [] and pool.close() == []


# A process that makes a spare of its own and holds it until killed.
_HOLDER = """
import sys, time
from pathlib import Path
from fila.egress.config import Gateway
from fila.sandbox.gateways import GatewayPool

def make(spare, network, state, labels):
    state.mkdir(parents=True)
    return Gateway("", "n", "g", "", state, [])

pool = GatewayPool(make, lambda gw: None, Path(sys.argv[1]), {}, refill=False)
pool.want("egress")
gw = pool.take("egress")
print(gw.spare, flush=True)
time.sleep(60)
"""


def test_a_one_shot_hands_what_is_left_to_remove_to_a_reaper_and_removes_it_itself_when_none_takes_it(
    engine: Engine, tmp_path: Path
) -> None:
    """`close(handoff)` (a process about to exit: sandbox/docker/reap.py) gives the reaper the
    spare still being discarded and the one never taken, without waiting for either; a backend
    without a reaper (False) or one that fails leaves close to remove them as before."""
    slow = threading.Event()
    real_remove = engine.remove

    def remove(gw: Gateway) -> None:
        slow.wait(10)
        real_remove(gw)

    def pool_with_work() -> tuple[GatewayPool, Gateway]:
        slow.clear()
        pool = GatewayPool(engine.make, remove, tmp_path / "spares", {"fila.root": str(tmp_path)})
        pool.want("egress")
        taken = pool.take("egress")
        assert taken is not None
        pool.discard(taken)  # its removal waits on `slow`
        pool.want("egress")  # the next spare, made and never taken
        return pool, taken

    def gone(pool: GatewayPool, taken: Gateway) -> bool:
        idle = engine.made[-1]
        return taken.container in engine.removed and idle.container in engine.removed

    # No reaper: close waits for the discard and removes the spare not taken.
    pool, taken = pool_with_work()
    threading.Timer(0.2, slow.set).start()
    assert pool.close() == [] and gone(pool, taken)
    # A reaper takes both, at once: nothing is removed here, nor waited for.
    given: list[list[str]] = []

    def reaper(gws: list[Gateway], directory: Path) -> bool:
        given.append([g.container for g in gws])
        return True

    pool, taken = pool_with_work()
    assert pool.close(reaper) == [] and not {taken.container, engine.made[-1].container} & set(engine.removed)
    assert len(given) == 1 and given[0][0] == taken.container and len(given[0]) == 2, given
    slow.set()
    # No reaper on this backend (False), or one that cannot start: removed here after all.
    for none_takes in (lambda gws, d: False, lambda gws, d: (_ for _ in ()).throw(OSError("no python"))):
        pool, taken = pool_with_work()
        threading.Timer(0.2, slow.set).start()
        said = pool.close(none_takes)
        assert gone(pool, taken), engine.removed
        assert said == [] or any("no python" in s for s in said), said


def test_what_a_finished_reaper_wrote_is_said_by_recovery_once_and_a_live_ones_log_is_left(
    tmp_path: Path,
) -> None:
    """A one-shot's reaper writes what it could not remove (or a traceback) to its log beside its
    lock; recovery says it (inert text) and removes it, but not while that reaper still holds its
    lock (it may write more)."""
    from fila.core.fsutil import held_new_lock
    from fila.sandbox.gateways import reapers_said

    spares = tmp_path / "spares"
    spares.mkdir()
    (spares / "reap-aaaaaaaaaaaa.log").write_text("2026 network fila-net-x: in use\x1b[31m\n\n")
    live = held_new_lock(spares / "reap-bbbbbbbbbbbb.lock")
    (spares / "reap-bbbbbbbbbbbb.log").write_text("still at work\n")
    said = reapers_said(spares)
    assert len(said) == 1 and "network fila-net-x: in use" in said[0] and "\x1b" not in said[0], said
    assert not (spares / "reap-aaaaaaaaaaaa.log").exists() and (spares / "reap-bbbbbbbbbbbb.log").exists()
    assert reapers_said(spares) == []  # said once
    live()
    assert reapers_said(spares) == ["a one-shot's reaper said: still at work"]


def test_a_reaper_gets_the_callers_import_path_without_its_working_directory_and_no_tcp_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper's sys.path is the caller's in the caller's order (the standard library before
    site-packages, PYTHONPATH's entries kept), less the entry the interpreter put first and the
    working directory; a daemon not reached by a Unix socket (a TCP, TLS or SSH context) is
    never handed to a reaper, which would resolve it again (the caller removes its gateways)."""
    import os

    import docker

    from fila.sandbox.docker import reap

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "sys.path", ["/script-dir", "/from/pythonpath", "/usr/lib/python3.11", "rel", str(tmp_path), "/site"]
    )
    assert reap.import_path() == ["/from/pythonpath", "/usr/lib/python3.11", "/site"]
    tcp = docker.DockerClient(base_url="tcp://127.0.0.1:9", version="1.41")
    spares = tmp_path / "spares"
    spares.mkdir()
    gw = Gateway("job", "net", "gw", "", spares / "s", [])
    assert reap.handoff(tcp, [gw], spares) is False and os.listdir(spares) == []
