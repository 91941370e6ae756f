"""The PostgreSQL queue's store on a real PostgreSQL (docs/architecture.md, "The PostgreSQL
queue"): schema versions, the queue URL and its errors, claims by several processes, leases and
fencing tokens on the database's clock, sweeps within the retry budget and past the side-effect
boundary, lost notifications, restarts and killed servers, and checked blobs. Each refused case
shows its allowed counterpart first. The cluster is tests/support/pg.py's (fixture `pg_cluster`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fila.core.errors import DuplicateId, InvalidTransition
from fila.core.models import ErrorInfo, ErrorKind, Status, Task
from fila.queue.pg import migrate
from fila.queue.pg.blobs import Blob
from fila.queue.pg.errors import (
    BlobMismatch,
    QueueAuthFailed,
    QueueUnreachable,
    QueueUrlInvalid,
    SchemaMismatch,
)
from fila.queue.pg.store import PgQueue
from fila.queue.retry import RetryPolicy
from fila.queue.store import LeaseLost
from tests.support.pg import FAKETIME_LIB, tamper_blob

S = Status
NOW = RetryPolicy(attempts=None, base=0.0, cap=0.0, jitter=False)  # a sweep's requeue without backoff


def task(engine: str = "shell") -> Task:
    return Task(engine=engine, targets=["a.txt"], command="true")


def sql(url: str, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, args or None)
        return cur.fetchall() if cur.description else []


def expire(q: PgQueue, task_id: str) -> None:
    """Let a claim's lease lapse on the database's clock (a claim with a tiny ttl, then this)."""
    while q.task_state(task_id)["lease_expires_at"] > q.clock():
        time.sleep(0.01)


# -- schema -----------------------------------------------------------------------------------


def test_migrate_creates_the_schema_once_and_refuses_a_newer_one(pg_cluster: Any) -> None:
    url = pg_cluster.new_database()
    assert migrate.migrate(url) == (0, migrate.latest())
    assert migrate.migrate(url) == (migrate.latest(), migrate.latest())  # a no-op
    assert sql(url, "SELECT version FROM fila_schema ORDER BY version") == [
        (1,),
        (2,),
        (3,),
        (4,),
        (5,),
        (6,),
    ]
    with PgQueue(url) as queue:  # the allowed counterpart: the schema this fila knows
        queue.enqueue("t1", task())
    sql(url, "INSERT INTO fila_schema (version, name) VALUES (%s, 'from_the_future')", migrate.latest() + 1)
    with pytest.raises(SchemaMismatch) as err:
        migrate.migrate(url)
    assert f"schema version {migrate.latest() + 1}" in str(err.value) and "up to 6" in str(err.value)
    assert "upgrade fila" in (err.value.hint or "") and err.value.exit_code == 4
    with pytest.raises(SchemaMismatch):
        PgQueue(url)
    assert sql(url, "SELECT id, state FROM fila_tasks") == [("t1", "queued")]  # nothing touched
    # A database never migrated is refused too, with what to run.
    with pytest.raises(SchemaMismatch) as err:
        PgQueue(pg_cluster.new_database())
    assert "fila queue init" in (err.value.hint or "")


def test_runners_migrating_together_apply_each_migration_once(pg_cluster: Any) -> None:
    url = pg_cluster.new_database()
    results: list[tuple[int, int]] = []
    threads = [threading.Thread(target=lambda: results.append(migrate.migrate(url))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4 and {after for _, after in results} == {6}
    assert [before for before, _ in results].count(0) == 1  # one created it, the others found it
    assert sql(url, "SELECT version, name FROM fila_schema ORDER BY version") == [
        (1, "init"),
        (2, "record_ids_and_claim_nonce"),
        (3, "runners"),
        (4, "append_only_and_runner_policies"),
        (5, "breaker"),
        (6, "trusted_keys"),
    ]


# -- the queue URL and its errors ---------------------------------------------------------------


def test_the_password_comes_only_from_libpq_and_no_error_shows_it(
    pg_cluster: Any, pg_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cret-Pw"
    role = "fila_pw_" + hashlib.sha256(pg_url.encode()).hexdigest()[:6]
    pg_cluster.admin(f"CREATE ROLE {role} LOGIN PASSWORD '{secret}'")
    hba = pg_cluster.data / "pg_hba.conf"
    hba.write_text(f"local all {role} scram-sha-256\n" + hba.read_text())
    pg_cluster.admin("SELECT pg_reload_conf()")
    schema = pg_url.rsplit("%3D", 1)[1]
    sql(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    sql(pg_url, f"GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {role}")
    sql(pg_url, f"GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
    url = pg_url.replace("user=postgres", f"user={role}")
    monkeypatch.delenv("PGPASSWORD", raising=False)
    # Allowed: the password from PGPASSWORD, then from a 0600 password file.
    monkeypatch.setenv("PGPASSWORD", secret)
    with PgQueue(url) as queue:
        queue.enqueue("by-env", task())
    monkeypatch.delenv("PGPASSWORD")
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"*:*:*:{role}:{secret}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    with PgQueue(url) as queue:
        assert queue.get("by-env").status == S.queued
    # Refused: a URL that embeds the password, masked in the message.
    embedded = f"postgresql://{role}:{secret}@/{url.split('///')[1].split('?')[0]}?host={pg_cluster.sock}"
    with pytest.raises(QueueUrlInvalid) as bad:
        PgQueue(embedded)
    assert secret not in str(bad.value) + (bad.value.hint or "") and f"{role}@" in str(bad.value)
    assert "PGPASSWORD" in (bad.value.hint or "") and bad.value.exit_code == 2
    with pytest.raises(QueueUrlInvalid):
        PgQueue(url + f"&password={secret}")
    with pytest.raises(QueueUrlInvalid):
        PgQueue("mysql://db/fila")
    # Wrong credentials: named with user, host and database, never the password.
    monkeypatch.delenv("PGPASSFILE")
    monkeypatch.setenv("PGPASSWORD", "wrong-" + secret)
    with pytest.raises(QueueAuthFailed) as auth:
        PgQueue(url)
    text = str(auth.value) + (auth.value.hint or "")
    assert secret not in text and role in text and str(pg_cluster.sock) in text and "refused" in text
    assert auth.value.exit_code == 3
    # A database that does not exist, and a server that is not there.
    monkeypatch.delenv("PGPASSWORD")
    with pytest.raises(QueueAuthFailed, match="does not exist"):
        PgQueue(pg_cluster.url("no_such_db"))
    gone = f"postgresql:///fila?host={tmp_path}/nowhere&user=postgres"
    with pytest.raises(QueueUnreachable) as down:
        PgQueue(gone)
    assert f"{tmp_path}/nowhere" in str(down.value) and "pg_isready" in (down.value.hint or "")


def test_no_message_quotes_a_refused_url_whatever_its_password_holds() -> None:
    from fila.queue.pg.conninfo import parse

    # The allowed counterpart: a URL without a password parses, with its other parameters.
    assert parse("postgresql://fila@db.example/q?sslmode=require")["sslmode"] == "require"
    refused = [
        "postgresql://fila:hunter?2@db.example/q",  # '?' in the password
        "postgresql://fila:hunter#2@db.example/q",  # '#' in the password
        "postgresql://fila@db.example/q?pass%77ord=hunter2",  # the parameter's name percent-encoded
        "postgresql://fila@db.example/q?password=hunter2&x",  # unreadable: libpq quotes the URL
        "postgresql://fila:hun?ter2@[::1/q",  # unreadable
        "postgresql://fila@db.example/q?sslpassword=hunter2",  # the client key's passphrase
        "mysql://fila:hunter2@db.example/q",  # another scheme
    ]
    for url in refused:
        with pytest.raises(QueueUrlInvalid) as bad:
            parse(url)
        text = str(bad.value) + (bad.value.hint or "")
        assert "hunter" not in text and "hun?ter" not in text and "db.example/q?" not in text, text
    with pytest.raises(QueueUrlInvalid, match=r"fila@db\.example:5432/q holds a sslpassword"):
        parse(refused[-2])


def test_the_url_is_masked_wherever_a_password_could_appear_and_psycopg_loads_only_when_used() -> None:
    from fila.queue.pg.conninfo import describe, mask

    assert mask("postgresql://fila:hunter2@db:5432/q") == "postgresql://fila:***@db:5432/q"
    assert mask("postgresql://fila@db/q?sslmode=require&password=hunter2") == (
        "postgresql://fila@db/q?sslmode=require&password=***"
    )
    assert mask("host=db password='a b\\'c' user=fila") == "host=db password=*** user=fila"
    assert mask("postgresql://fila@db/q") == "postgresql://fila@db/q"  # nothing to hide: unchanged
    assert describe({"user": "fila", "host": "db", "dbname": "q"}) == "fila@db:5432/q"
    code = (
        "import sys; import fila.queue.pg.store, fila.queue.pg.migrate; "
        "print(sorted(m for m in sys.modules if m.startswith('psycopg')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- submit and claim ---------------------------------------------------------------------------


def test_an_id_in_use_is_refused_and_the_first_task_kept(q: PgQueue) -> None:
    rec = q.enqueue("t1", task())
    assert rec.status == S.queued and rec.task is not None and rec.task.id == "t1"
    with pytest.raises(DuplicateId, match="exists already"):
        q.enqueue("t1", Task(engine="shell", targets=["b"], command="false"))
    assert q.get("t1") == rec and [e["event"] for e in q.events("t1")] == ["submitted"]


def test_a_runner_claims_only_tasks_of_its_engines_oldest_first(q: PgQueue) -> None:
    q.enqueue("a-claude", task("claude"))
    q.enqueue("b-shell", task())
    q.enqueue("c-shell", task())
    assert q.claim("r-codex", ["codex"], 30) is None  # no task for its engines: it waits
    first = q.claim("r1", ["shell"], 30)
    assert first is not None and first.task_id == "b-shell" and first.attempt == 1
    second = q.claim("r2", ["shell", "claude"], 30)
    assert second is not None and second.task_id == "a-claude" and second.token > first.token
    rec = q.get("b-shell")
    assert rec.status == S.running and rec.worker == "r1" and rec.attempts[-1].worker == "r1"


_RUNNER = r"""
import json, sys, time
from fila.queue.pg.store import PgQueue
url, runner, mode = sys.argv[1:4]
out = {"runner": runner, "claimed": [], "local_time": time.time()}
with PgQueue(url) as q:
    print("ready", flush=True)
    sys.stdin.readline()  # every runner is connected: they start together
    if mode == "drain":
        while (lease := q.claim(runner, ["shell"], 60)) is not None:
            out["claimed"].append([lease.task_id, lease.token])
    else:
        lease = q.claim(runner, ["shell"], 30)
        out["claimed"].append([lease.task_id, lease.token])
        out["expires_at"] = lease.expires_at.timestamp()
        out["renewed"] = q.renew(lease.task_id, lease.token, 30).timestamp()
        out["db_now"] = q.clock().timestamp()
print(json.dumps(out))
"""


def runners(url: str, n: int, mode: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RUNNER, url, f"runner-{i}", mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for i in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.communicate(timeout=60)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    return outs


def test_four_runner_processes_claim_each_of_400_tasks_exactly_once(q: PgQueue, pg_url: str) -> None:
    ids = [f"t{i:04d}" for i in range(400)]
    for tid in ids:
        q.enqueue(tid, task(), notify=False)
    outs = runners(pg_url, 4, "drain")
    claimed = [tid for o in outs for tid, _token in o["claimed"]]
    tokens = [token for o in outs for _tid, token in o["claimed"]]
    assert sorted(claimed) == ids  # every task, none twice
    assert len(set(tokens)) == 400
    assert all(len(o["claimed"]) > 0 for o in outs), [len(o["claimed"]) for o in outs]  # they raced
    by_runner = {tid: o["runner"] for o in outs for tid, _ in o["claimed"]}
    rows = sql(pg_url, "SELECT id, state, runner, attempt FROM fila_tasks")
    assert all(
        state == "running" and by_runner[tid] == runner and att == 1 for tid, state, runner, att in rows
    )
    assert {r.worker for r in q.listing(S.running)[0]} == {o["runner"] for o in outs}


# -- leases and fencing ------------------------------------------------------------------------


def test_renew_holds_with_the_current_token_and_fails_with_an_old_one(q: PgQueue) -> None:
    q.enqueue("t1", task())
    old = q.claim("r1", ["shell"], 30)
    assert old is not None
    assert q.renew("t1", old.token, 60) > old.expires_at  # allowed: the lease is extended
    q.renew("t1", old.token, 0.05)
    expire(q, "t1")
    # Expired on the database's clock: lost, though no sweep has moved the task yet.
    with pytest.raises(LeaseLost):
        q.renew("t1", old.token, 30)
    assert q.publish("t1", old.token, S.needs_review, {}) is None
    assert q.events("t1")[-1]["reason"] == "lease expired" and q.get("t1").status == S.running
    assert q.sweep(policy=NOW) == [("t1", S.queued)]  # requeued with a new token
    new = q.claim("r2", ["shell"], 30)
    assert new is not None and new.task_id == "t1" and new.token > old.token and new.attempt == 2
    assert q.renew("t1", new.token, 30) > new.expires_at
    with pytest.raises(LeaseLost):
        q.renew("t1", old.token, 30)
    with pytest.raises(LeaseLost):
        q.mark_started("t1", old.token, container="c-old")
    st = q.task_state("t1")
    assert (st["runner"], st["token"], st["started"]) == ("r2", new.token, False)


def test_a_late_publish_with_an_old_token_changes_nothing(q: PgQueue, pg_url: str) -> None:
    q.enqueue("t1", task())
    old = q.claim("r1", ["shell"], 0.05)
    assert old is not None
    expire(q, "t1")
    q.sweep(policy=NOW)
    new = q.claim("r2", ["shell"], 30)
    assert new is not None
    before = (q.get("t1"), q.task_state("t1"))
    late = q.publish("t1", old.token, S.needs_review, {"exit_code": 0}, [Blob.of("DIFF.patch", b"late\n")])
    assert late is None
    assert (q.get("t1"), q.task_state("t1")) == before
    assert sql(pg_url, "SELECT count(*) FROM fila_blobs") == [(0,)] and q.task_blobs("t1") == {}
    assert q.events("t1")[-1]["event"] == "result discarded"
    # The allowed counterpart: the current token publishes, blobs and all, once.
    diff = Blob.of("DIFF.patch", b"--- a\n+++ b\n")
    rec = q.publish("t1", new.token, S.needs_review, {"exit_code": 0}, [diff, Blob.of("log", b"ok\n")])
    assert rec is not None and rec.status == S.needs_review and rec.worker == "r2" and rec.exit_code == 0
    assert rec.attempts[-1].outcome == "success" and rec.attempts[-1].ended_at is not None
    assert q.task_blobs("t1")["DIFF.patch"] == diff.sha256 and q.blob(diff.sha256) == diff.data
    # Published already: sent again (its reply lost), the record is returned, never written twice.
    assert q.publish("t1", new.token, S.failed, {}) == rec == q.get("t1")
    assert [e["event"] for e in q.events("t1")].count("published") == 1


def test_an_expired_lease_is_requeued_within_the_budget_and_needs_a_human_beyond_it(q: PgQueue) -> None:
    q.enqueue("t1", task(), max_tries=2)
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None and q.sweep(policy=NOW) == []  # a live lease is left alone
    q.renew("t1", lease.token, 0.05)
    expire(q, "t1")
    assert q.sweep(policy=NOW) == [("t1", S.queued)]
    rec = q.get("t1")
    assert rec.status == S.queued and rec.worker is None and rec.attempts[-1].outcome == "lost"
    assert q.task_state("t1")["tries"] == 1
    again = q.claim("r2", ["shell"], 0.05)
    assert again is not None and again.token > lease.token
    expire(q, "t1")
    assert q.sweep(policy=NOW) == [("t1", S.needs_human)]  # the budget (2 tries) is spent
    rec = q.get("t1")
    assert rec.error is not None and "tries are spent" in rec.error.message and rec.diagnosis
    # A person retries it: queued again, a new token; a queued task cannot be retried.
    assert q.retry("t1", by="alice", reason="flaky host").status == S.queued
    with pytest.raises(InvalidTransition):
        q.retry("t1", by="alice")
    third = q.claim("r3", ["shell"], 30)
    assert third is not None and third.token > again.token and third.attempt == 3


def test_a_lease_lost_after_the_started_mark_goes_to_a_person_not_the_queue(q: PgQueue) -> None:
    q.enqueue("t1", task())
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None
    # Before the mark a runner may hand the task back (its container never started).
    assert q.hand_back("t1", lease.token, ErrorInfo(kind=ErrorKind.infra, message="daemon down")) is not None
    assert q.get("t1").status == S.queued and q.task_state("t1")["tries"] == 1
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None
    rec = q.mark_started("t1", lease.token, container="fila-t1-1")
    assert rec.container_started and rec.container == "fila-t1-1"
    with pytest.raises(InvalidTransition, match="container started"):
        q.hand_back("t1", lease.token, None)
    q.renew("t1", lease.token, 0.05)
    expire(q, "t1")
    assert q.sweep(policy=NOW) == [("t1", S.needs_human)]  # budget left, but the container ran
    rec = q.get("t1")
    assert rec.error is not None and rec.error.kind == ErrorKind.interrupted
    assert "while its container ran" in rec.error.message and "fila retry t1" in (rec.diagnosis or "")
    with pytest.raises(LeaseLost):
        q.renew("t1", lease.token, 30)


def test_two_sweepers_decide_each_expired_lease_once(pg_url: str, q: PgQueue) -> None:
    for i in range(40):
        q.enqueue(f"t{i:02d}", task())
    leases = [q.claim("r1", ["shell"], 30) for _ in range(40)]
    for i, lease in enumerate(leases):
        assert lease is not None
        if i % 2 == 0:  # half of them had started their container
            q.mark_started(lease.task_id, lease.token, container=f"c-{lease.task_id}")
        q.renew(lease.task_id, lease.token, 0.05)
    expire(q, "t39")
    decided: list[tuple[str, Status]] = []

    def sweeper() -> None:
        with PgQueue(pg_url) as mine:
            while found := mine.sweep(policy=NOW, limit=3):
                decided.extend(found)

    threads = [threading.Thread(target=sweeper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(tid for tid, _ in decided) == [f"t{i:02d}" for i in range(40)]  # each once
    assert dict(decided) == {f"t{i:02d}": S.needs_human if i % 2 == 0 else S.queued for i in range(40)}
    assert q.sweep(policy=NOW) == []


def test_a_checkpoint_needs_the_token_and_a_decision_is_recorded_once(q: PgQueue) -> None:
    from fila.core.models import Decision, ImageRef

    q.enqueue("t1", task())
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None
    rec = q.checkpoint("t1", lease.token, event="image", image=ImageRef(tag="fila/shell:latest"))
    assert rec.image is not None and rec.image.tag == "fila/shell:latest" and rec.status == S.running
    with pytest.raises(LeaseLost):
        q.checkpoint("t1", lease.token + 1000, image=None)
    assert q.get("t1").image == rec.image
    assert q.counts() == {"running": {"shell": 1}}
    q.publish("t1", lease.token, S.needs_review, {})
    first = Decision(action="applied", by="alice", at="2026-01-01T00:00:00+00:00")
    rec = q.decide("t1", S.applied, first, expect={S.needs_review})
    assert rec.status == S.applied and rec.decision == first
    again = Decision(action="rejected", by="bob", at="2026-01-01T00:00:01+00:00")
    with pytest.raises(InvalidTransition):
        q.decide("t1", S.rejected, again, expect={S.needs_review, S.needs_human, S.failed})
    assert q.get("t1").decision == first and q.counts() == {"applied": {"shell": 1}}
    assert [e["event"] for e in q.events("t1")][-1] == "decided"


def test_a_hand_back_spends_the_budget_and_the_last_one_fails_the_task(q: PgQueue) -> None:
    q.enqueue("t1", task(), max_tries=2)
    down = ErrorInfo(kind=ErrorKind.infra, message="the container engine does not answer")
    first = q.claim("r1", ["shell"], 30)
    assert first is not None
    assert q.hand_back("t1", first.token, None, counted=False) is not None  # asked to stop: free
    second = q.claim("r1", ["shell"], 30)
    assert second is not None and q.hand_back("t1", first.token, down) is None  # stale token: no-op
    rec = q.hand_back("t1", second.token, down, backoff_s=0.2)
    assert rec is not None and rec.status == S.queued and rec.not_before is not None
    assert q.claim("r1", ["shell"], 30) is None  # its backoff is not over
    time.sleep(0.25)
    third = q.claim("r1", ["shell"], 30)
    assert third is not None and third.attempt == 3
    rec = q.hand_back("t1", third.token, down)
    assert rec is not None and rec.status == S.failed and rec.error is not None
    assert "gave up after 2 attempts" in rec.error.message


@pytest.mark.skipif(not FAKETIME_LIB.exists(), reason="scripts/postgres-up installs faketime")
def test_the_database_clock_decides_a_lease_not_the_runners(q: PgQueue, pg_url: str) -> None:
    q.enqueue("ahead", task())
    q.enqueue("behind", task())
    outs = [
        runners(pg_url, 1, "lease", env={"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": skew})[0]
        for skew in ("+1h", "-1h")
    ]
    for out, skew in zip(outs, (3600, -3600), strict=True):
        assert abs(out["local_time"] - time.time() - skew) < 60  # the runner's clock is off
        assert 25 < out["expires_at"] - out["db_now"] <= 30  # its lease is a normal one
        assert 25 < out["renewed"] - out["db_now"] <= 30
    assert q.sweep(policy=NOW) == []  # neither lease looks expired to anyone
    assert {r.id for r in q.listing(S.running)[0]} == {"ahead", "behind"}


# -- wake-ups -----------------------------------------------------------------------------------


def _claim_in_thread(url: str, poll_s: float) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}
    ready = threading.Event()

    def wait() -> None:
        with PgQueue(url) as queue:
            queue.claim_wait("r1", ["shell"], 30, poll_s=0.01, timeout=0.01)  # connected, listening
            ready.set()
            lease = queue.claim_wait("r1", ["shell"], 30, poll_s=poll_s, timeout=15)
            got["at"], got["lease"] = time.monotonic(), lease

    t = threading.Thread(target=wait)
    t.start()
    assert ready.wait(15)
    time.sleep(0.2)  # the waiter is inside its wait
    return t, got


def test_a_lost_notify_still_gets_the_task_claimed_within_the_poll_interval(q: PgQueue, pg_url: str) -> None:
    # Allowed: with its NOTIFY, a runner polling every 10 s claims the task at once.
    t, got = _claim_in_thread(pg_url, poll_s=10)
    start = time.monotonic()
    q.enqueue("noticed", task())
    t.join(15)
    assert got["lease"].task_id == "noticed" and got["at"] - start < 3  # not after its 10 s poll
    # Lost: no NOTIFY; a runner polling every second claims it within the interval (and a claim).
    t, got = _claim_in_thread(pg_url, poll_s=1.0)
    start = time.monotonic()
    q.enqueue("silent", task(), notify=False)
    t.join(15)
    assert got["lease"].task_id == "silent" and got["at"] - start < 2


# -- restarts -----------------------------------------------------------------------------------


def test_the_store_reconnects_after_a_restart_and_a_killed_server_and_loses_nothing(
    q: PgQueue, pg_cluster: Any
) -> None:
    for i in range(10):
        q.enqueue(f"t{i}", task())
    leases = [q.claim("r1", ["shell"], 60) for _ in range(3)]
    assert all(lease is not None for lease in leases)
    pg_cluster.restart()  # clean: pg_ctl restart -m fast
    assert len(q.listing()[0]) == 10 and len(q.listing(S.running)[0]) == 3
    for lease in leases:
        assert lease is not None and q.renew(lease.task_id, lease.token, 60) > lease.expires_at
    pg_cluster.kill9()  # the postmaster killed; the server comes back while the store waits
    starter = threading.Timer(0.5, pg_cluster.start)
    starter.start()
    q.enqueue("t10", task())  # blocks until the server is back, then succeeds once
    starter.join()
    rec = q.publish(leases[0].task_id, leases[0].token, S.needs_review, {}, [Blob.of("log", b"x")])
    assert rec is not None and rec.status == S.needs_review
    states = {r.id: r.status for r in q.listing()[0]}
    assert len(states) == 11 and sorted(states.values()).count(S.running) == 2
    assert [e["event"] for e in q.events("t10")] == ["submitted"]  # written once
    # A server that stays away longer than the wait: a clear error naming it, nothing half-done.
    pg_cluster.stop()
    q.reconnect_s = 1.0
    try:
        with pytest.raises(QueueUnreachable) as err:
            q.get("t1")
        assert str(pg_cluster.sock) in str(err.value) and "did not answer for 1 s" in str(err.value)
    finally:
        pg_cluster.start()
    q.reconnect_s = 20
    assert q.get("t10").status == S.queued


# -- blobs --------------------------------------------------------------------------------------


def test_a_blob_whose_sha256_does_not_match_is_refused_on_write_and_on_read(q: PgQueue, pg_url: str) -> None:
    import psycopg

    q.enqueue("t1", task())
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None
    bad = Blob("DIFF.patch", b"what the runner saw\n", hashlib.sha256(b"something else\n").hexdigest())
    with pytest.raises(BlobMismatch, match=r"DIFF\.patch") as err:
        q.publish("t1", lease.token, S.needs_review, {}, [Blob.of("log", b"fine\n"), bad])
    assert err.value.exit_code == 4
    assert q.get("t1").status == S.running and q.task_blobs("t1") == {}  # nothing written
    assert sql(pg_url, "SELECT count(*) FROM fila_blobs") == [(0,)]
    good = Blob.of("DIFF.patch", b"what the runner saw\n")
    assert q.publish("t1", lease.token, S.needs_review, {}, [good]) is not None
    assert q.blob(good.sha256) == good.data
    # The database refuses such a row by itself too...
    with pytest.raises(psycopg.errors.CheckViolation):
        sql(pg_url, "INSERT INTO fila_blobs (sha256, size, data) VALUES (%s, 3, 'abc')", bad.sha256)
    # ...and bytes changed behind fila's back are refused on the way out.
    tamper_blob(pg_url, good.sha256, b"what the runner saw\n", b"tampered")
    with pytest.raises(BlobMismatch, match="other bytes"):
        q.blob(good.sha256)


def test_events_are_append_only(q: PgQueue, pg_url: str) -> None:
    import psycopg

    q.enqueue("t1", task())
    sql(pg_url, "INSERT INTO fila_events (task_id, event) VALUES ('t1', 'note')")  # appending: allowed
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "UPDATE fila_events SET event = 'rewritten'")
    for erase in (
        "DELETE FROM fila_events",
        "TRUNCATE fila_events",
        "TRUNCATE fila_tasks CASCADE",
        "DELETE FROM fila_tasks",
    ):
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            sql(pg_url, erase)
    assert [e["event"] for e in q.events("t1")] == ["submitted", "note"]


# -- what a runner may write ---------------------------------------------------------------------


def test_a_runner_writes_only_its_results_and_only_into_its_own_tasks_record(q: PgQueue, pg_url: str) -> None:
    from fila.queue.store import next_record

    for tid in ("A", "B", "C"):
        q.enqueue(tid, task())
    a = q.claim("r1", ["shell"], 30)
    assert a is not None and a.task_id == "A"
    # Allowed: results of the run, in a checkpoint and in the publish.
    assert q.checkpoint("A", a.token, event="image", timings={"pull": 1.0}).timings == {"pull": 1.0}
    before = {tid: (q.get(tid), q.events(tid)) for tid in ("A", "B", "C")}
    # Refused: the queue's own fields, whichever way they come; nothing written anywhere.
    forged = [
        {"id": "B"},
        {"status": "needs_review"},
        {"submitted_at": "1999-01-01T00:00:00+00:00"},
        {"decision": {"action": "applied", "by": "alice", "at": "2026-01-01T00:00:00+00:00"}},
        {"attempts": []},
        {"container_started": True, "container": "c1"},
        {"worker": "r9"},
        {"attempt": 7},
        {"task": None},
    ]
    for fields in forged:
        with pytest.raises(InvalidTransition, match=sorted(fields)[0]):
            q.checkpoint("A", a.token, **fields)
        with pytest.raises(InvalidTransition, match=sorted(fields)[0]):
            q.publish("A", a.token, S.needs_review, fields)
    assert {tid: (q.get(tid), q.events(tid)) for tid in ("A", "B", "C")} == before
    assert q.task_state("A")["state"] == "running" and q.task_state("B")["state"] == "queued"
    # The shared record builder refuses them too (the file queue's writes go through it).
    with pytest.raises(InvalidTransition, match=r"\bid is the queue's"):
        next_record("A", q.get("A"), S.running, "2026-01-01T00:00:00+00:00", changes={"id": "B"})
    # And the schema: a record stored under another task's id.
    import psycopg

    with pytest.raises(psycopg.errors.CheckViolation):
        sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{id}', '\"B\"') WHERE id = 'A'")
    rec = q.publish("A", a.token, S.needs_review, {"exit_code": 0})
    assert rec is not None and rec.id == "A" and rec.decision is None
    b = q.claim("r2", ["shell"], 30)  # the other tasks are claimed as before
    assert b is not None and b.task_id == "B"


def test_a_sweep_decides_every_row_and_one_whose_record_cannot_say_so_goes_to_a_person_alone(
    q: PgQueue, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    for tid in ("bad", "good"):
        q.enqueue(tid, task(), max_tries=5)
    bad = q.claim("r1", ["shell"], 0.05)
    good = q.claim("r2", ["shell"], 0.05)
    assert bad is not None and good is not None and bad.task_id == "bad"
    # A record changed outside fila so that no decision can be written from it.
    sql(
        pg_url,
        "UPDATE fila_records SET record = jsonb_set(record, '{status}', '\"applied\"') WHERE id = 'bad'",
    )
    expire(q, "bad")
    expire(q, "good")
    with caplog.at_level("ERROR", logger="fila.queue.pg.store"):
        got = q.sweep(policy=NOW)
    assert sorted(got) == [("bad", S.needs_human), ("good", S.queued)]  # good decided all the same
    st = q.task_state("bad")  # the row alone: a person's, its runner fenced off, never swept again
    assert st["state"] == "needs_human" and st["token"] != bad.token and q.sweep(policy=NOW) == []
    assert "task bad (lease lapsed) to needs_human" in caplog.text  # reported, not silently skipped
    assert any("record cannot be read" in e.get("why", "") for e in q.events("bad"))
    assert q.get("good").status == S.queued and q.claim("r3", ["shell"], 30) is not None


def test_a_database_at_schema_version_1_upgrades_with_its_tasks(pg_cluster: Any) -> None:
    url = pg_cluster.new_database()
    first = migrate.migrations()[0]
    sql(url, migrate.VERSION_TABLE)
    sql(url, first.sql)
    sql(url, "INSERT INTO fila_schema (version, name) VALUES (1, %s)", first.name)
    doc = task().model_copy(update={"id": "t1"}).model_dump(mode="json", exclude_none=True)
    sql(
        url,
        "INSERT INTO fila_tasks (id, state, task, engine) VALUES ('t1', 'queued', %s, 'shell')",
        json.dumps(doc),
    )
    sql(url, "INSERT INTO fila_records (id, record) VALUES ('t1', %s)",
        json.dumps({"id": "t1", "status": "queued", "task": doc}))  # fmt: skip
    with pytest.raises(SchemaMismatch, match="fila needs 6"):
        PgQueue(url)
    assert migrate.migrate(url) == (1, 6)
    with PgQueue(url) as queue:
        assert queue.get("t1").status == S.queued


# -- lost replies, bad documents, database errors -------------------------------------------------


@pytest.fixture
def lossy(pg_cluster: Any, pg_url: str) -> Iterator[tuple[PgQueue, Any]]:
    """A queue reached through a proxy that drops COMMIT replies on request."""
    from tests.support.pgproxy import Proxy

    px = Proxy(str(pg_cluster.sock))
    with PgQueue(px.url(pg_url, str(pg_cluster.sock)), reconnect_s=10) as queue:
        yield queue, px
    px.close()


def test_a_claim_whose_commit_reply_is_lost_returns_its_own_task_not_a_second(
    lossy: tuple[PgQueue, Any], pg_url: str
) -> None:
    pq, px = lossy
    for tid in ("A", "B", "C"):
        pq.enqueue(tid, task())
    first = pq.claim("r1", ["shell"], 30)  # the allowed counterpart: a claim that is answered
    assert first is not None and first.task_id == "A"
    px.drop_commits = 1
    lease = pq.claim("r1", ["shell"], 30)
    assert px.dropped == 1 and lease is not None and lease.task_id == "B"
    assert (pq.task_state("B")["token"], pq.task_state("C")["state"]) == (lease.token, "queued")
    assert [e["event"] for e in pq.events("B")].count("claimed") == 1
    pq.renew("B", lease.token, 30)


def test_repeated_writes_after_a_lost_reply_are_recognised_as_done(lossy: tuple[PgQueue, Any]) -> None:
    from fila.core.models import Decision

    pq, px = lossy
    pq.enqueue("A", task())
    lease = pq.claim("r1", ["shell"], 30)
    assert lease is not None
    px.drop_commits = 1
    assert pq.mark_started("A", lease.token, container="c1").container_started
    assert [e["event"] for e in pq.events("A")].count("container started") == 1
    rec = pq.publish("A", lease.token, S.needs_review, {"exit_code": 0})
    assert rec is not None
    # Sent again by its caller (after QueueUnreachable, say): the same record, not "discarded".
    assert pq.publish("A", lease.token, S.needs_review, {"exit_code": 0}) == rec
    assert "result discarded" not in [e["event"] for e in pq.events("A")]
    d = Decision(action="applied", by="alice", at="2026-01-01T00:00:00+00:00")
    px.drop_commits = 1
    applied = pq.decide("A", S.applied, d, expect={S.needs_review})
    assert applied.status == S.applied and px.dropped == 2
    assert pq.decide("A", S.applied, d, expect={S.needs_review}) == applied  # the same decision
    other = Decision(action="rejected", by="bob", at="2026-01-01T00:00:01+00:00")
    with pytest.raises(InvalidTransition):  # another decision is refused, as before
        pq.decide("A", S.rejected, other, expect={S.needs_review})
    assert [e["event"] for e in pq.events("A")].count("decided") == 1


def test_a_task_whose_stored_document_does_not_validate_fails_and_the_next_is_claimed(
    q: PgQueue, pg_url: str
) -> None:
    from fila.core.errors import InvalidInput
    from fila.core.models import Limits

    for tid in ("poison", "deep", "good"):
        q.enqueue(tid, task())
    # Refused at enqueue: a task built without validation, or whose engine is not a name.
    unchecked = Task.model_construct(
        engine="shell", targets=["a.txt"], command="true", policy="default", prompt="",
        limits=Limits.model_construct(memory="0"),
    )  # fmt: skip
    with pytest.raises(InvalidInput, match="does not validate"):
        q.enqueue("unchecked", unchecked)
    with pytest.raises(InvalidInput, match="engine name"):
        q.enqueue("long", task("x" * 4000))
    # Documents changed in the database after they were queued: one that no longer validates, one
    # nested past Python's recursion limit (jsonb takes it; the standard library's reader would
    # crash every runner that claims it).
    sql(pg_url, 'UPDATE fila_tasks SET task = task || \'{"limits": {"memory": "0"}}\' WHERE id = \'poison\'')
    nested = "[" * 1500 + "]" * 1500
    sql(pg_url, "UPDATE fila_tasks SET task = jsonb_set(task, '{options}', %s::jsonb) WHERE id = 'deep'",
        '{"shell": {"x": ' + nested + "}}")  # fmt: skip
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None and lease.task_id == "good"
    for tid, why in (("poison", "does not validate"), ("deep", "nesting deeper than")):
        rec = q.get(tid)
        assert rec.status == S.failed and rec.error is not None and why in rec.error.message, rec.error
        assert q.task_state(tid)["state"] == "failed" and q.task_state(tid)["runner"] is None


def test_a_database_error_that_another_try_cannot_fix_is_raised_at_once(q: PgQueue, pg_url: str) -> None:
    from fila.queue.pg.errors import QueueFailed

    q.enqueue("t1", task())  # the allowed counterpart
    sql(pg_url, "ALTER TABLE fila_events ADD CONSTRAINT short CHECK (octet_length(event) < 20)")
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None
    t0 = time.monotonic()
    with pytest.raises(QueueFailed, match="refused the operation") as err:
        q.checkpoint("t1", lease.token, event="x" * 30)
    # Refused at once: a transient error would be retried for the pool's reconnect_s (30 s).
    assert time.monotonic() - t0 < 15 and "check constraint" in str(err.value)
    assert err.value.exit_code == 3 and q.task_state("t1")["state"] == "running"


def test_a_publish_replaces_the_blobs_of_an_earlier_attempt(q: PgQueue) -> None:
    q.enqueue("t1", task())
    a = q.claim("r1", ["shell"], 30)
    assert a is not None
    err = ErrorInfo(kind=ErrorKind.infra, message="boom")
    first = [Blob.of("DIFF.patch", b"attempt 1 diff\n"), Blob.of("log", b"attempt 1 log\n")]
    assert q.publish("t1", a.token, S.failed, {"error": err}, first) is not None
    assert sorted(q.task_blobs("t1")) == ["DIFF.patch", "log"]
    q.retry("t1", by="alice")
    b = q.claim("r2", ["shell"], 30)
    assert b is not None
    log = Blob.of("log", b"attempt 2 log\n")
    assert q.publish("t1", b.token, S.failed, {"error": err}, [log]) is not None
    assert q.task_blobs("t1") == {"log": log.sha256}  # attempt 1's diff is not named any more


# -- fila queue init ----------------------------------------------------------------------------


def test_fila_queue_init_creates_then_reports_and_refuses_a_newer_schema(
    pg_cluster: Any, tmp_path: Any
) -> None:
    from tests.support.cli import fila

    url = pg_cluster.new_database()
    res = fila(tmp_path, "queue", "init", "--queue", url)
    assert res.exit_code == 0, res.output
    assert "created the queue schema, version 6," in res.stdout and "postgres@" in res.stdout
    res = fila(tmp_path, "queue", "init", "--queue", url, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["schema"], doc["version_before"], doc["version"]) == ("current", 6, 6)
    sql(url, "INSERT INTO fila_schema (version, name) VALUES (7, 'from_the_future')")
    res = fila(tmp_path, "queue", "init", "--queue", url)
    assert res.exit_code == 4 and "schema version 7" in res.output and "upgrade fila" in res.output
    res = fila(
        tmp_path, "queue", "init", "--queue", url.replace("user=postgres", "user=postgres&password=pw9")
    )
    assert res.exit_code == 2 and "pw9" not in res.output and "PGPASSWORD" in res.output
    res = fila(tmp_path, "queue", "init", "--queue", f"postgresql:///fila?host={tmp_path}/nowhere")
    assert res.exit_code == 3 and "does not answer" in res.output
