"""The PostgreSQL queue's runners under faults of the world around them (docs/scale-out.md, "What
fila promises"; issue 23's failure cases): a runner whose wall clock is an hour ahead or behind
(a real `fila worker --queue` under Debian's libfaketime, tests/support/faketime.py), and a runner
partitioned from the database by a real network namespace and an nftables rule
(tests/support/netns.py). Each fault is shown after its allowed counterpart: a normal clock, no
cut. The fake backend runs the tasks (no containers: the container is not the point here)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from fila.core.models import Status
from fila.queue.pg import migrate
from fila.queue.pg.store import PgQueue
from tests.support import faketime, netns
from tests.support.pg_runner import CLI, events, fila, host_env, start_worker
from tests.support.pgproxy import Proxy
from tests.support.project import make_project, make_root

S = Status
LOST = "lease lost; nothing published"


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)


def _at(iso: str | None) -> float:
    assert iso is not None
    return datetime.fromisoformat(iso).timestamp()


def submit(url: str, sub: Root, tid: str, command: str) -> None:
    res = fila("submit", "--queue", url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
               "--command", command, "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output


@pytest.fixture
def sub(tmp_path: Path) -> Root:
    return make_project(tmp_path / "submitter")


# -- a runner's clock an hour off ---------------------------------------------------------------


@dataclass
class Host:
    """One runner "host" with its own queue (a schema of the session's cluster), reached through
    a proxy the test can silence, and its wall clock moved by `skew_s`."""

    name: str
    skew_s: int
    url: str
    q: PgQueue
    px: Proxy
    root: Root
    err: Path
    proc: subprocess.Popen[bytes] | None = None


@pytest.mark.slow
@pytest.mark.skipif(faketime.unavailable() is not None, reason=str(faketime.unavailable()))
def test_a_runner_whose_clock_is_an_hour_off_keeps_and_loses_its_leases_by_the_database_clock(
    pg_cluster: Any, sub: Root, tmp_path: Path
) -> None:
    """Three runners at once, each on its own queue: a normal clock (the allowed counterpart),
    an hour ahead, an hour behind. Each drains its queue once (a task that outlives its first
    lease keeps it by renewal: not lost early), publishes times on the database's clock, beats on
    it, and, once its network goes silent, stops its container within the lease (not kept late:
    a runner that judged the lease by its own clock would think it had an hour more, or none)."""
    hosts: list[Host] = []
    try:
        for name, skew in (("normal", 0), ("ahead", 3600), ("behind", -3600)):
            url = pg_cluster.new_database()
            migrate.migrate(url)
            px = Proxy(str(pg_cluster.sock))
            h = Host(name, skew, url, PgQueue(url, reconnect_s=20), px, make_root(tmp_path / name),
                     tmp_path / f"{name}.err")  # fmt: skip
            hosts.append(h)
            submit(url, sub, "short", "echo short >> greeting.txt")
            submit(url, sub, "long", "sleep 4; echo long >> greeting.txt")  # outlives its 3 s lease
            submit(url, sub, "cut", "sleep 60")
            env = host_env(tmp_path, name)
            if skew:
                env = faketime.skewed(env, f"{skew:+d}")
            via = px.url(url, str(pg_cluster.sock))
            h.proc = start_worker(via, h.root.path, name, "--once", "--lease", "3", env=env)
        for h in hosts:  # the normal clock first: the allowed counterpart
            _wait(lambda h=h: h.q.task_state("cut")["started"], 60, f"{h.name}: the third task to start")
            state, now = h.q.task_state("cut"), h.q.clock()
            left = (state["lease_expires_at"] - now).total_seconds()
            assert 0 < left <= 3, (h.name, left)  # a lease of 3 s on the database's clock
            for tid in ("short", "long"):
                rec = h.q.get(tid)
                assert rec.status == S.needs_review and rec.attempt == 1, (h.name, tid, rec.error)
                assert [len(events(h.q, tid, e)) for e in ("claimed", "published")] == [1, 1], (h.name, tid)
                # The record's times are the database's: the attempt lies between the claim and
                # the publish as the database saw them (the runner's clock is an hour off).
                claimed = _at(events(h.q, tid, "claimed")[0]["at"])
                published = _at(events(h.q, tid, "published")[0]["at"])
                [ran] = rec.attempts
                start, end = _at(ran.started_at), _at(ran.ended_at)
                assert claimed - 1 <= start <= end <= published + 1, (h.name, tid, ran, claimed, published)
            long = h.q.get("long").attempts[0]
            assert _at(long.ended_at) - _at(long.started_at) >= 4  # the run's own duration, kept
            [me] = h.q.runners(60)  # its heartbeat is on the database's clock: live, seen just now
            assert me["live"] and 0 <= me["seen_s"] < 10, (h.name, me)
            assert abs(_at(me["started_at"]) - now.timestamp()) < 60, (h.name, me)
        for h in hosts:
            h.px.freeze()  # a network that drops every packet: no renewal gets through
        t0 = time.monotonic()
        for h in hosts:
            # Stopped within the lease after its last renewal on its own monotonic clock, then
            # its next check; the bound is a third of the task's 60 s, far from an hour.
            _wait(lambda h=h: LOST in h.err.read_text(), 20, f"{h.name}: the runner to give the lease up")
        assert time.monotonic() - t0 < 20
        for h in hosts:
            assert h.proc is not None
            h.proc.kill()
            h.proc.wait(10)
            from fila.sandbox.fake import FakeBackend

            assert FakeBackend(tmp_path / f"{h.name}.boxes").find(job_id="cut") == []  # stopped
            _wait(lambda h=h: h.q.task_state("cut")["lease_expires_at"] <= h.q.clock(), 10, "the lease")
            assert h.q.sweep() == [("cut", S.needs_human)]
            assert events(h.q, "cut", "published") == []
            # The runner's clock was off as asked: its own journal of the lost job (kept for a
            # person) has the claim on its clock, an hour from the database's.
            [kept] = (h.root.path / "remote").glob("cut.*")
            local = json.loads((kept / "fila" / "out" / "cut.json").read_text())
            claimed = _at(events(h.q, "cut", "claimed")[0]["at"])
            assert abs(_at(local["attempts"][0]["started_at"]) - claimed - h.skew_s) < 60, h.name
    finally:
        for h in hosts:
            if h.proc is not None:
                h.proc.kill()
                h.proc.wait(10)
            h.px.cut()
            h.px.close()
            h.q.close()


# -- a runner partitioned from the database -----------------------------------------------------


@pytest.fixture(scope="module")
def parted() -> Iterator[tuple[netns.Netns, netns.TcpCluster]]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    with netns.partitionable() as both:
        yield both


def _runner_in(ns: netns.Netns, url: str, root: Path, host: str, *extra: str, env: dict[str, str]) -> Any:
    """`fila worker --queue URL` inside the namespace; its stderr in ROOT/../HOST.err."""
    with open(root.parent / f"{host}.err", "wb") as err:
        argv = ns.argv(*CLI, "worker", "--queue", url, "--root", str(root), "--host-id", host, *extra)
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)


@pytest.mark.slow
def test_a_runner_partitioned_shorter_than_its_lease_carries_on_and_longer_gives_the_task_up(
    parted: tuple[netns.Netns, netns.TcpCluster], sub: Root, tmp_path: Path
) -> None:
    ns, cluster = parted
    ns.check_isolated()  # before the first request: the namespace reaches this machine only
    url = cluster.new_database()
    migrate.migrate(url)
    tcp = cluster.tcp(url)
    err = tmp_path / "h1.err"
    h1 = make_root(tmp_path / "h1")
    with PgQueue(url, reconnect_s=20) as q:
        # Lease 6 s, renewed every 2 s; the runner in the namespace reaches the database on TCP.
        p = _runner_in(ns, tcp, h1.path, "h1", "--poll", "0.2", "--lease", "6", env=host_env(tmp_path, "h1"))
        try:
            # The allowed counterpart: no cut.
            submit(url, sub, "plain", "echo plain >> greeting.txt")
            _wait(lambda: q.get("plain").status == S.needs_review, 60, "the first task")
            # Cut for 2 s while the container runs, less than the lease: a renewal fails or
            # waits, the next one gets through, and the task is published once.
            submit(url, sub, "blip", "sleep 4; echo blip >> greeting.txt")
            _wait(lambda: q.task_state("blip")["started"], 30, "the second task to start")
            assert ns.reaches(cluster.port)
            ns.cut()
            t0 = time.monotonic()
            assert not ns.reaches(cluster.port)  # silent: a connection neither made nor refused
            time.sleep(max(0.0, 2 - (time.monotonic() - t0)))
            ns.heal()
            _wait(lambda: q.get("blip").status not in (S.queued, S.running), 60, "the second task")
            rec = q.get("blip")
            assert rec.status == S.needs_review and rec.attempt == 1, (rec.status, err.read_text())
            assert [len(events(q, "blip", e)) for e in ("claimed", "published")] == [1, 1]
            assert LOST not in err.read_text()
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 0, err.read_text()
        finally:
            p.kill()
            p.wait(10)

        # Cut for longer than the lease (3 s) while the container runs: the runner stops its
        # container within the lease on its own clock and publishes nothing; the database's clock
        # expires the lease, a sweep sends the task to a person (its container had started); a
        # person's retry, and it runs once on another host, outside the namespace. The task sleeps
        # only where it sees the namespace's interface.
        slow = f"if [ -e /sys/class/net/{ns.ns_dev} ]; then sleep 60; fi; echo cut >> greeting.txt"
        submit(url, sub, "cut", slow)
        p = _runner_in(ns, tcp, h1.path, "h1", "--poll", "0.2", "--lease", "3", env=host_env(tmp_path, "h1"))
        try:
            _wait(lambda: q.task_state("cut")["started"], 30, "the third task to start")
            ns.cut()
            _wait(lambda: LOST in err.read_text(), 20, "the runner to give the lease up")
            from fila.sandbox.fake import FakeBackend

            assert FakeBackend(tmp_path / "h1.boxes").find(job_id="cut") == []  # its container stopped
            _wait(lambda: q.task_state("cut")["lease_expires_at"] <= q.clock(), 10, "the lease to expire")
            assert q.sweep() == [("cut", S.needs_human)]
            rec = q.get("cut")
            assert rec.status == S.needs_human and rec.error is not None, rec.status
            assert "while its container ran" in rec.error.message
            res = fila("retry", "cut", "--queue", url)
            assert res.exit_code == 0, res.output
            h2 = make_root(tmp_path / "h2")
            out = subprocess.run([*CLI, "worker", "--queue", url, "--root", str(h2.path), "--host-id",
                                  "h2", "--once"], env=host_env(tmp_path, "h2"), capture_output=True,
                                 timeout=60)  # fmt: skip
            assert out.returncode == 0, out.stderr
            ns.heal()  # h1 is back: it has nothing to publish for the task
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 0, err.read_text()
        finally:
            p.kill()
            p.wait(10)
            ns.heal()
        rec = q.get("cut")
        assert rec.status == S.needs_review and rec.worker == "h2", rec.status
        assert [(a.worker, a.outcome) for a in rec.attempts] == [("h1", "lost"), ("h2", "success")]
        assert [e["token"] for e in events(q, "cut", "published")] == [q.task_state("cut")["token"]]
        assert b"+cut" in q.blob(q.task_blobs("cut")["DIFF.patch"])
