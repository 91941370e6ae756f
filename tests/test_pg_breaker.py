"""The PostgreSQL queue's circuit breaker (docs/scale-out.md, "The circuit breaker across hosts"):
one per queue database, counted in each publish's own transaction by the file queue's rules
(queue/breaker.verdict), refused in the claim statement while open, closed only by `fila rearm
--queue`. Real PostgreSQL (tests/support/pg.py); two store clients play two hosts; one runner on
the fake backend shows the threshold from its policy, the message and `--once`'s exit 6."""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from fila.core.models import ErrorInfo, ErrorKind, Status, Task
from fila.queue.pg.records import iso
from fila.queue.pg.store import PgQueue
from fila.run import remote_publish
from tests.support.pg_runner import events, fila, host_env, start_worker
from tests.support.policy import edit_policy
from tests.support.project import make_project, make_root
from tests.support.queues import wait_for

S = Status
INFRA = {"error": ErrorInfo(kind=ErrorKind.infra, message="the engine's image would not start")}


def task() -> Task:
    return Task(engine="shell", targets=["a.txt"], command="true")


def run_one(q: PgQueue, host: str, status: Status, *, threshold: int | None = 3) -> str:
    """One claim by `host` published with `status` (a counted failure unless needs_review)."""
    lease = q.claim(host, ["shell"], 30)
    assert lease is not None
    fields = {} if status == S.needs_review else INFRA
    assert q.publish(lease.task_id, lease.token, status, fields, threshold=threshold) is not None
    return lease.task_id


def test_failures_from_two_hosts_open_the_breaker_no_host_claims_until_rearm(q: PgQueue, pg_url: str) -> None:
    for i in range(9):
        q.enqueue(f"t{i}", task())
    with PgQueue(pg_url, reconnect_s=20) as other:
        hosts = {"h1": q, "h2": other}
        # Below the threshold, then a success: the count starts again.
        run_one(q, "h1", S.failed)
        run_one(other, "h2", S.needs_human)
        assert (q.breaker().consecutive, other.breaker().open) == (2, False)
        run_one(other, "h2", S.needs_review)
        assert q.breaker().consecutive == 0
        run_one(q, "h1", S.failed)
        run_one(other, "h2", S.failed)
        # A publish under a stale token (its lease ran out) writes nothing and counts nothing.
        lease = q.claim("h1", ["shell"], 0.2)
        assert lease is not None
        time.sleep(0.3)
        assert q.publish(lease.task_id, lease.token, S.failed, INFRA, threshold=3) is None
        assert q.breaker().consecutive == 2
        # Nor does the sweep that decides that expired lease (the file queue's recovery counts nothing).
        assert q.sweep() == [(lease.task_id, S.queued)]
        assert q.breaker().consecutive == 2
        # The third failure in a row, across both hosts, opens it.
        last = run_one(other, "h2", S.failed)
        st = q.breaker()
        assert st.open and st.consecutive == 3 and st.threshold == 3 and st.tripped_by == "h2"
        assert st.reason is not None and last in st.reason and st.recent[-1] == last
        assert st.tripped_at is not None and st.tripped_at == iso(datetime.fromisoformat(st.tripped_at))
        # While open the claim statement itself refuses, for every host; the queued tasks wait.
        queued = {r.id for r in q.listing(S.queued)[0]}
        assert queued and all(h.claim(name, ["shell"], 30) is None for name, h in hosts.items())
        assert {r.id for r in q.listing(S.queued)[0]} == queued

        shown = fila("status", "--queue", pg_url, "--json")
        assert shown.exit_code == 0 and json.loads(shown.output)["breaker"]["open"] is True
        assert "breaker:  OPEN since" in fila("status", "--queue", pg_url).output
        res = fila("rearm", "--queue", pg_url, "--by", "ana", "-m", "image rebuilt")
        assert res.exit_code == 0 and "rearmed by ana" in res.output, res.output
        st = other.breaker()
        assert not st.open and st.consecutive == 0 and st.rearmed_by == "ana" and st.rearmed_at
        assert [(e["event"], e.get("by")) for e in q.breaker_events()] == [
            ("tripped", None),
            ("rearmed", "ana"),
        ]
        assert q.breaker_events()[1]["reason"] == "image rebuilt" and q.breaker_events()[1]["was_open"]
        lease = other.claim("h2", ["shell"], 30)
        assert lease is not None and lease.task_id in queued
        # Without a threshold from its runner, a failure counts against the default.
        assert other.publish(lease.task_id, lease.token, S.failed, INFRA) is not None
        st = q.breaker()
        assert (st.open, st.consecutive, st.threshold) == (False, 1, 5)


def test_a_hand_back_counts_nothing_until_its_retries_run_out_and_the_task_fails(q: PgQueue) -> None:
    q.enqueue("again", task(), max_tries=3)
    q.enqueue("spent", task(), max_tries=1)
    lease = q.claim("h1", ["shell"], 30)
    assert lease is not None and lease.task_id == "again"
    assert q.hand_back("again", lease.token, INFRA["error"], backoff_s=60).status == S.queued
    assert q.breaker().consecutive == 0
    lease = q.claim("h1", ["shell"], 30)
    assert lease is not None and lease.task_id == "spent"
    assert q.hand_back("spent", lease.token, INFRA["error"]).status == S.failed
    st = q.breaker()
    assert (st.consecutive, st.recent, st.threshold) == (1, ["spent"], 5)


def test_a_given_up_hand_back_counts_against_its_policys_threshold(q: PgQueue, tmp_path: Path) -> None:
    # A runner's hand back (run/remote_publish.py) passes the task's policy's threshold, as its
    # publish does: here 2, so the second task that gives up opens the breaker, not the fifth.
    runner = make_root(tmp_path / "runner")
    edit_policy(runner, "default", to="strict", max_consecutive_failures=2)
    for tid in ("s1", "s2"):
        q.enqueue(tid, task().model_copy(update={"policy": "strict"}), max_tries=1)
    for n, tid in enumerate(("s1", "s2"), 1):
        lease = q.claim("h1", ["shell"], 30)
        assert lease is not None and lease.task_id == tid
        rec = remote_publish.hand_back(q, lease, runner, INFRA["error"], counted=True, backoff_s=0.0)
        assert rec is not None and rec.status == S.failed
        st = q.breaker()
        assert (st.consecutive, st.threshold, st.open) == (n, 2, n == 2)
    assert st.tripped_by == "h1" and st.reason is not None and "max_consecutive_failures 2" in st.reason


def test_breaker_events_are_append_only(q: PgQueue, pg_url: str) -> None:
    import psycopg

    q.rearm(by="ana")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fila_breaker_events").fetchone() == (1,)
        with pytest.raises(psycopg.Error, match="append-only"):
            conn.execute("DELETE FROM fila_breaker_events")


def expire(pg_url: str, tid: str) -> None:
    """Task `tid`'s lease ended now on the database's clock, as if its runner had gone."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE fila_tasks SET lease_expires_at = now() WHERE id = %s", (tid,))


def test_a_runner_trips_it_at_its_policys_threshold_says_so_and_exits_6_with_once(
    pg_url: str, q: PgQueue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = make_project(tmp_path / "submitter")
    runner = make_root(tmp_path / "runner")
    for root in (sub, runner):  # one failure the author did not choose (the policy's timeout) trips it
        edit_policy(root, "default", to="strict", max_consecutive_failures=1, default_timeout_ms=1000)
    for tid, command, pol in (
        ("ok", "true", "strict"),
        ("slow", "sleep 30", "strict"),
        ("after", "true", "default"),
    ):
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
                   "--command", command, "--policy", pol, "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0, res.output
    # Two tasks no runner here takes (engine `ghost`), claimed now: their leases, expired by hand
    # below, show the long-running runner's polls (its sweep says "lease expired" for each).
    for tid in ("g1", "g2"):
        q.enqueue(tid, Task(engine="ghost", targets=["a.txt"], command="true"))
        assert q.claim("elsewhere", ["ghost"], 300) is not None
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    worker = ["worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once"]
    res = fila(*worker)
    assert res.exit_code == 6, res.output
    assert "fila worker h1: circuit breaker open: 1 consecutive tasks failed" in res.output
    assert "run `fila rearm --queue URL`" in res.output
    assert (q.get("ok").status, q.get("slow").status, q.get("after").status) == (
        S.needs_review,
        S.failed,
        S.queued,
    )
    st = q.breaker()
    assert st.open and st.threshold == 1 and st.recent == ["slow"] and st.tripped_by == "h1"
    assert len(events(q, "after", "claimed")) == 0
    # A long-running runner started now says so once, keeps polling, and claims after the rearm.
    proc = start_worker(pg_url, runner.path, "h2", "--poll", "0.2", env=host_env(tmp_path, "h2"))
    try:
        err = tmp_path / "h2.err"
        wait_for(lambda: "circuit breaker open" in err.read_text())
        # Two more polls at least: g2's sweep comes a poll after g1's, whose breaker check it follows.
        for ghost in ("g1", "g2"):
            expire(pg_url, ghost)
            wait_for(
                lambda ghost=ghost: f"{ghost}: lease expired" in err.read_text(), what=f"{ghost}'s sweep"
            )
        assert err.read_text().count("circuit breaker open") == 1 and q.get("after").status == S.queued
        assert fila("rearm", "--queue", pg_url, "--by", "ana").exit_code == 0
        wait_for(lambda: q.get("after").status == S.needs_review)
        assert q.get("after").worker == "h2"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
