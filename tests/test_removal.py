"""sandbox/docker/removal.remove_in_turn: containers that share a network leave it one at a time, and
a gateway's removal waits for the host's departure lock (docs/security.md, "Spare gateways"). The
daemon here is a scripted one: a removal "already in progress" (another client's) that ends when
the script says is what a real daemon cannot be made to show on demand; the real daemon's paths are
in tests/test_egress.py (a gateway and its holder removed by egress.stop and by the one-shot's
reaper)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import docker
import pytest
import requests

from fila.sandbox.docker import removal
from fila.sandbox.docker.removal import departure_locks, remove_in_turn
from tests.support.containers import held_elsewhere


class Daemon:
    """remove_container and inspect_container for named containers; `busy[name]` is how long
    another client's removal of it still runs (409 "already in progress" until then)."""

    base_url = "http+docker://scripted"

    def get_adapter(self, url: str) -> object:
        return object()  # no Unix socket: the departure lock is keyed on base_url

    def __init__(self, names: list[str], busy: dict[str, float]) -> None:
        self.alive = set(names)
        self.until = {n: time.monotonic() + s for n, s in busy.items()}
        self.calls: list[tuple[str, str, bool]] = []  # (call, name, was anything else still there)

    def remove_container(self, name: str, force: bool, v: bool) -> None:
        self.calls.append(("remove", name, bool(self.alive - {name})))
        if name in self.until:
            said = f"removal of container {name} is already in progress"
            raise docker.errors.APIError("Conflict", response=_response(409), explanation=said)
        self.alive.discard(name)

    def inspect_container(self, name: str) -> dict[str, Any]:
        if name in self.until and time.monotonic() >= self.until[name]:
            del self.until[name]
            self.alive.discard(name)
        if name not in self.alive:
            raise docker.errors.NotFound(f"no such container: {name}", response=_response(404))
        return {"Name": name}


def _response(code: int) -> requests.Response:
    r = requests.Response()
    r.status_code = code
    return r


class Client:
    def __init__(self, api: Daemon) -> None:
        self.api = api


@pytest.fixture(autouse=True)
def lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The scripted daemon's departure lock (it has no Unix socket, so no lock of its own)."""
    path = tmp_path / "docker.sock.fila-departures.lock"
    monkeypatch.setattr(removal, "departure_locks", lambda _client: [path])
    return path


def test_the_holder_goes_only_once_the_gateway_is_gone_and_is_left_when_it_is_not() -> None:
    # Allowed: the gateway's removal (another client's, in progress) ends within the deadline:
    # the holder is removed after it, with nothing else left.
    api = Daemon(["gw", "gw-netns"], busy={"gw": 0.2})
    assert remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 5) == []  # type: ignore[arg-type]
    assert [c[:2] for c in api.calls] == [("remove", "gw"), ("remove", "gw-netns")]
    assert api.calls[1][2] is False, "the holder was removed while the gateway was still there"
    assert api.alive == set()
    # Blocked: the gateway is still going at the deadline: the holder is not touched (it would
    # leave the network beside it), and both are said, for recovery.
    api = Daemon(["gw", "gw-netns"], busy={"gw": 5.0})
    errors = remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 0.2)  # type: ignore[arg-type]
    assert [c[:2] for c in api.calls] == [("remove", "gw")]
    assert len(errors) == 2 and "container gw:" in errors[0] and "did not end in time" in errors[0]
    assert errors[1] == "container gw-netns: left, since gw was not gone"


def test_a_gateways_removal_waits_while_another_process_holds_the_departure_lock(lock: Path) -> None:
    # Allowed: the lock free, the gateway is removed at once, the holder after it.
    api = Daemon(["gw", "gw-netns"], busy={})
    assert remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 5) == []  # type: ignore[arg-type]
    assert [c[:2] for c in api.calls] == [("remove", "gw"), ("remove", "gw-netns")]
    # Blocked: another process's gateway is departing (it holds the lock): no removal is asked
    # for until it lets go, then the turn runs as before. A gateway halted already has left its
    # networks: its removal does not wait.
    api, halted = Daemon(["gw", "gw-netns"], busy={}), Daemon(["gw"], busy={})
    errors: list[list[str]] = []
    with held_elsewhere(lock) as release:
        turn = threading.Thread(
            target=lambda: errors.append(
                remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 30)  # type: ignore[arg-type]
            )
        )
        turn.start()
        assert remove_in_turn(Client(halted), ["gw"], time.monotonic() + 5, leaving=False) == []  # type: ignore[arg-type]
        assert halted.calls == [("remove", "gw", False)]
        time.sleep(0.5)
        assert api.calls == [] and turn.is_alive(), "the gateway was removed while another departed"
        release()
        turn.join(10)
    assert errors == [[]] and [c[:2] for c in api.calls] == [("remove", "gw"), ("remove", "gw-netns")]


def test_a_departure_lock_kept_for_good_delays_a_removal_by_its_wait_once(
    lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that keeps the lock (a fila stopped with ^Z) cannot stop every job of the host:
    past DEPARTURE_WAIT_S the removal goes ahead without it, and the departures after it in that
    process wait DEPARTURE_RECHECK_WAIT_S, not a whole wait each (a sweep of many gateways), until
    it is free."""
    monkeypatch.setattr(removal, "DEPARTURE_WAIT_S", 0.4)
    api = Daemon(["gw", "gw2"], busy={})
    with held_elsewhere(lock):
        t = time.monotonic()
        assert remove_in_turn(Client(api), ["gw"], time.monotonic() + 30) == []  # type: ignore[arg-type]
        waited = time.monotonic() - t
        assert waited >= 0.4 and api.calls == [("remove", "gw", True)], (waited, api.calls)
        # The next departure of this process: waited for briefly, not for a whole wait (one this
        # long would still be running).
        monkeypatch.setattr(removal, "DEPARTURE_WAIT_S", 60.0)
        went: list[list[str]] = []
        turn = threading.Thread(
            target=lambda: went.append(remove_in_turn(Client(api), ["gw2"], time.monotonic() + 30))
        )  # type: ignore[arg-type]
        turn.start()
        turn.join(10)
        assert went == [[]] and not turn.is_alive(), "a second whole wait for a lock kept for good"
    # Allowed: once it is free, it is held again.
    with removal.departure(Client(api)) as held:  # type: ignore[arg-type]
        assert held is True


def test_a_departure_lock_that_cannot_be_opened_is_gone_without(lock: Path) -> None:
    """A lock this process cannot open (a directory here; a file of a group it is not in is
    the same error) does not stop the removal."""
    api = Daemon(["gw"], busy={})
    lock.mkdir()
    with removal.departure(Client(api)) as held:  # type: ignore[arg-type]
        assert held is False
    assert remove_in_turn(Client(api), ["gw"], time.monotonic() + 5) == []  # type: ignore[arg-type]
    assert api.calls == [("remove", "gw", False)]
    # Allowed counterpart: once the name is free, the lock is made and held.
    lock.rmdir()
    with removal.departure(Client(api)) as held:  # type: ignore[arg-type]
        assert held is True


def test_a_departure_is_not_starved_by_a_process_departing_back_to_back(
    lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fila process that departs gateway after gateway (recovery's sweep, a pool's close), the
    next as soon as the last is done, does not starve another's single departure (a job's
    halt): the departer leaves the lock free (DEPARTURE_GAP_S) for several of a waiter's tries
    (DEPARTURE_POLL_S) before it takes it again."""
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from fila.sandbox.docker import removal\n"
        f"removal.departure_locks = lambda _client: [Path({str(lock)!r})]\n"
        "print('go', flush=True)\n"
        "end = time.monotonic() + 30\n"
        "while time.monotonic() < end:\n"
        "    with removal.departure(None) as held:\n"
        "        assert held\n"
        "        time.sleep(0.1)  # a gateway's kill, answered\n"
    )
    # Five of the sweeper's holds: a waiter that finds none of its pauses goes without.
    monkeypatch.setattr(removal, "DEPARTURE_WAIT_S", 0.5)
    sweeper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert sweeper.stdout is not None and sweeper.stdout.readline().strip() == "go"
        time.sleep(0.2)
        got = []
        for _ in range(6):
            with removal.departure(Client(Daemon([], busy={}))) as held:  # type: ignore[arg-type]
                got.append(held)
            assert sweeper.poll() is None, "the sweeper ended: nothing was being waited for"
        assert got == [True] * 6, got
    finally:
        sweeper.kill()
        sweeper.wait()


def test_one_daemon_has_one_departure_lock_beside_its_socket_whatever_its_spelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is beside the daemon's socket, by the socket's real path (`/var/run` is a link
    to `/run` on most hosts): every spelling of one socket finds one lock, readable and
    writable by the socket's group when that group may use the socket (every user who may speak
    to the daemon), nobody else, and given that group and mode back when it lost them; a daemon
    over TCP has none."""
    monkeypatch.undo()  # the real departure_locks
    monkeypatch.setattr(removal, "OWN_DIR", str(tmp_path / "own-{uid}"))
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to(run)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(run / "docker.sock"))
    os.chown(run / "docker.sock", -1, 65534)
    (run / "docker.sock").chmod(0o660)  # as dockerd makes it: its group commands the daemon
    spellings = [
        run / "docker.sock",
        tmp_path / "var" / "run" / "docker.sock",
        f"{tmp_path}//run/./docker.sock",
    ]
    clients = [docker.DockerClient(base_url=f"unix://{p}", version="1.41") for p in spellings]
    beside = run / "docker.sock.fila-departures.lock"
    try:
        assert {departure_locks(c)[0] for c in clients} == {beside}
        with removal.departure(clients[1]) as held:
            assert held is True
        st = beside.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 65534), (oct(st.st_mode), st.st_gid)
        # Made while the socket was away (or its group changed since): given back at the next use.
        os.chown(beside, -1, 0)
        beside.chmod(0o600)
        with removal.departure(clients[0]) as held:
            assert held is True
        st = beside.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 65534), (oct(st.st_mode), st.st_gid)
        # A socket its group may not use (0600): its group gets nothing of the lock either.
        (run / "docker.sock").chmod(0o600)
        with removal.departure(clients[0]) as held:
            assert held is True
        assert stat.S_IMODE(beside.stat().st_mode) == 0o600
        tcp = docker.DockerClient(base_url="tcp://127.0.0.1:9", version="1.41")
        assert departure_locks(tcp) == []
        with removal.departure(tcp) as held:
            assert held is False
        tcp.close()
    finally:
        for c in clients:
            c.close()
        srv.close()


def test_a_socket_in_a_directory_others_write_to_gets_no_lock_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a socket in a directory anyone may write to (a forwarded socket in /tmp), whoever
    planted a file there would hold the lock: fila takes none there, only this user's own, in a
    directory of its own (its processes, reapers included, exclude each other), or none when
    what is at that directory's name is not this user's alone."""
    monkeypatch.undo()
    own = tmp_path / f"own-{os.getuid()}"
    monkeypatch.setattr(removal, "OWN_DIR", str(tmp_path / "own-{uid}"))
    trusted, shared = tmp_path / "run", tmp_path / "shared"
    for d, mode in ((trusted, 0o755), (shared, 0o1777)):
        d.mkdir()
        d.chmod(mode)
    servers = []
    for d in (trusted, shared):
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(str(d / "docker.sock"))
        servers.append(srv)
    at = {
        d: docker.DockerClient(base_url=f"unix://{d}/docker.sock", version="1.41") for d in (trusted, shared)
    }
    try:
        # Allowed: a socket in a directory only root writes to has its lock beside it.
        assert departure_locks(at[trusted])[0] == trusted / "docker.sock.fila-departures.lock"
        (mine,) = departure_locks(at[shared])
        assert mine.parent == own
        with removal.departure(at[shared]) as held:
            assert held is True
        assert not (shared / "docker.sock.fila-departures.lock").exists()
        assert stat.S_IMODE(own.stat().st_mode) == 0o700 and own.stat().st_uid == os.getuid()
        # Another user's directory at that name (made first, in a shared /tmp): no lock at all.
        mine.unlink()
        own.rmdir()
        own.mkdir(0o700)
        os.chown(own, 65534, 65534)
        with removal.departure(at[shared]) as held:
            assert held is False
        assert list(own.iterdir()) == []
    finally:
        for c in at.values():
            c.close()
        for srv in servers:
            srv.close()
