"""Recovery settles every partial state a crash can leave, without Docker (files, and the fake
backend's boxes for the containers a crash leaves).

Each test builds the exact leftovers of a crash at one instruction, runs recovery, and checks the
task is in exactly one state with an event saying what happened.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from fila.cli import app
from fila.core import fsutil
from fila.core.errors import InvalidTransition, RecordMismatch
from fila.core.layout import Root
from fila.core.models import ErrorInfo, ErrorKind, Status
from fila.queue import lease, retry
from fila.queue import store as queue
from fila.recovery import recover as recovery
from fila.run import job as cycle
from fila.sandbox.fake import FakeBackend
from tests.support.project import fake_backend, shell_task

S = Status
GONE: lease.AliveFn = lambda _w: "gone"  # noqa: E731
ALIVE: lease.AliveFn = lambda _w: "alive"  # noqa: E731


def recover(
    root: Root, alive: lease.AliveFn = GONE, ttl: float = 60, backend: FakeBackend | None = None
) -> recovery.Report:
    """Recovery with an engine that answers and holds no container (unless `backend` is given)."""
    return recovery.recover(root, backend=backend or fake_backend(root), alive=alive, ttl=ttl)


def actions(root: Root, tid: str) -> list[str]:
    return [e["action"] for e in queue.read_events(root, tid) if e["event"] == "recovered" and "action" in e]


def begun(root: Root, tid: str = "t1", worker: str = "w1") -> queue.Claim:
    queue.enqueue(root, tid, shell_task())
    c = queue.try_claim(root, root.queued_path(tid), worker)
    assert c is not None
    queue.begin(root, c, shell_task().model_copy(update={"id": tid}))
    return c


def started(root: Root, tid: str = "t1", worker: str = "w1") -> queue.Claim:
    c = begun(root, tid, worker)
    queue.checkpoint(root, c, container="fila-x", container_started=True)
    return c


def test_claim_of_a_dead_worker_before_its_container_started_is_requeued(root: Root) -> None:
    c = begun(root)
    rep = recover(root)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.queued and root.queued_path("t1").exists()
    assert not c.path.exists() and not c.tombstone("reaped").exists()
    assert rec.attempts[-1].outcome == "lost" and rec.error and rec.error.kind == "infra"
    assert rec.not_before is not None, "a requeue backs off"
    assert [a.action for a in rep.actions if a.task_id == "t1"] == ["reaped", "requeued"]


def test_repeated_losses_before_start_give_up_at_the_infra_cap(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    for n in range(1, retry.INFRA.attempts + 1):
        c = queue.try_claim(root, root.queued_path("t1"), f"w{n}")
        assert c is not None, n
        queue.begin(root, c, shell_task().model_copy(update={"id": "t1"}))
        recover(root)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.failed and "gave up" in rec.error.message  # type: ignore[union-attr]
    assert not root.queued_path("t1").exists() and not queue.claim_files(root, "t1")


def test_claim_of_a_dead_worker_after_its_container_started_needs_a_human(root: Root) -> None:
    c = started(root)
    recover(root)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.needs_human and rec.error and rec.error.kind == "interrupted"
    assert rec.diagnosis and "Nothing was run again" in rec.diagnosis and "w1" in rec.diagnosis
    assert not root.queued_path("t1").exists() and not queue.claim_files(root, "t1")
    assert rec.attempts[-1].outcome == "lost" and rec.attempts[-1].ended_at
    assert not c.path.exists()


def test_live_claims_are_left_alone(root: Root) -> None:
    c = started(root)
    recover(root, alive=ALIVE)
    assert c.path.exists() and queue.get_record(root, "t1").status == S.running


def test_an_expired_lease_is_reaped_and_the_slow_worker_is_fenced_off(root: Root) -> None:
    c = begun(root)
    old = time.time() - 600
    os.utime(c.path, (old, old))
    recover(root, alive=ALIVE, ttl=60)  # alive but silent for 10 minutes: stale by TTL
    assert queue.get_record(root, "t1").status == S.queued
    with pytest.raises(queue.LeaseLost):
        queue.checkpoint(root, c, container="late", container_started=True)
    assert queue.publish(root, c, S.needs_review, {}, attempt=1) is None
    assert queue.get_record(root, "t1").status == S.queued, "the late worker changed nothing"


def test_the_real_liveness_probe_sees_a_held_worker_lock(root: Root) -> None:
    me = queue.new_worker_id()
    lock = lease.WorkerLock(root, me).acquire()
    try:
        assert lease.worker_liveness(root, me) == "alive"
    finally:
        lock.release()
    assert lease.worker_liveness(root, me) == "gone"
    assert lease.worker_liveness(root, "otherhost-1-ab") == "unknown"


def test_a_done_tombstone_of_a_dead_worker_is_published_from_its_result(root: Root) -> None:
    c = started(root)
    fields = {"patch_path": "sandbox/jobs/t1/DIFF.patch", "patch_sha256": "0" * 64, "exit_code": 0}
    root.meta("t1").mkdir(parents=True)
    fsutil.atomic_write(
        queue.result_path(root, c),
        json.dumps({"claim": c.name, "attempt": 1, "status": "needs_review", "fields": fields}),
    )
    assert queue.win(c, "done")
    recover(root)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.needs_review and rec.exit_code == 0
    assert not queue.claim_files(root, "t1")
    assert rec.attempts[-1].outcome == "success"


def test_a_done_tombstone_whose_record_is_final_is_only_removed(root: Root) -> None:
    c = started(root)
    assert queue.win(c, "done")
    queue.finish_done(root, c, S.failed, {"error": ErrorInfo(kind=ErrorKind.timeout, message="t")}, attempt=1)
    recover(root)
    assert queue.get_record(root, "t1").status == S.failed and not queue.claim_files(root, "t1")


def test_a_reaped_tombstone_left_by_a_killed_recovery_is_settled(root: Root) -> None:
    c = started(root)
    assert queue.win(c, "reaped")
    recover(root, alive=ALIVE)
    assert queue.get_record(root, "t1").status == S.needs_human
    assert not queue.claim_files(root, "t1")


def test_a_queued_record_without_its_file_gets_the_file_back(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    root.queued_path("t1").unlink()  # as if submit died between its two writes
    recover(root)
    assert json.loads(root.queued_path("t1").read_text())["id"] == "t1"
    assert "file restored" in actions(root, "t1")


def test_an_interrupted_hand_back_is_completed(root: Root) -> None:
    c = begun(root)
    fsutil.durable_rename(c.path, root.queued_path("t1"))  # died after the rename
    recover(root, alive=ALIVE)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.queued and rec.worker is None and root.queued_path("t1").exists()


@pytest.mark.parametrize("container_started", [False, True])
def test_a_running_record_without_any_claim_is_settled(root: Root, container_started: bool) -> None:
    c = started(root) if container_started else begun(root)
    c.path.unlink()
    recover(root, alive=ALIVE)
    rec = queue.get_record(root, "t1")
    if container_started:
        assert rec.status == S.needs_human and not root.queued_path("t1").exists()
    else:
        assert rec.status == S.queued and root.queued_path("t1").exists()


def test_a_second_file_for_a_finished_task_is_kept_aside(root: Root) -> None:
    c = started(root)
    queue.publish(root, c, S.needs_review, {"patch_path": "p", "patch_sha256": "0" * 64}, attempt=1)
    root.queued_path("t1").write_text(queue.task_json(shell_task()))
    assert not cycle.claimable(root, root.queued_path("t1"), time.time())
    recover(root)
    assert not root.queued_path("t1").exists()
    assert (root.rejected_dir / "t1.json.reason").read_text().startswith("task t1 is already")
    assert queue.get_record(root, "t1").status == S.needs_review


def test_a_claimed_file_never_begun_goes_back_as_it_was(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    assert queue.try_claim(root, root.queued_path("t1"), "w1")
    recover(root)
    rec = queue.get_record(root, "t1")
    assert rec.status == S.queued and rec.attempt == 0 and root.queued_path("t1").exists()


def test_old_temp_files_are_removed_and_fresh_ones_kept(root: Root) -> None:
    # Outside fila/out/ no lock says the writer is gone: only the age does.
    fresh = [root.in_dir / ".t2.json.def456.tmp", root.state_dir / ".recovery.settled.json.fresh1.tmp"]
    old = [root.in_dir / ".t3.json.aaa111.tmp", root.state_dir / ".recovery.settled.json.old111.tmp"]
    in_out = root.out_dir / ".t1.json.abc123.tmp"  # a record's: removed under its lock, whatever its age
    for p in [*fresh, *old, in_out]:
        p.write_text("{")
    t = time.time() - 3600
    for p in old:
        os.utime(p, (t, t))
    recover(root)
    assert all(p.exists() for p in fresh), "a fresh temp file may be a live write"
    assert not any(p.exists() for p in old) and not in_out.exists()
    assert "temp file removed" in actions(root, "t1") and "temp file removed" in actions(root, "t3")


def test_a_record_naming_another_task_is_reported_and_neither_task_is_touched(root: Root) -> None:
    queue.enqueue(root, "x1", shell_task())
    root.queued_path("x1").unlink()
    queue.set_status(root, "x1", S.failed, error=ErrorInfo(kind=ErrorKind.invalid, message="x"))
    queue.enqueue(root, "x2", shell_task())
    recover(root)
    assert actions(root, "x2") == [] and root.queued_path("x2").exists(), "its own record: nothing to do"
    assert cycle.claimable(root, root.queued_path("x2"), time.time())
    x1_record = root.record_path("x1").read_bytes()
    root.record_path("x2").write_bytes(x1_record)  # a bad restore, a copy by hand
    res = CliRunner().invoke(app, ["recover", "--root", str(root.path), "--no-docker", "--json"])
    assert res.exit_code == 0, res.output
    found = [a for a in json.loads(res.output)["actions"] if a["task_id"] == "x2"]
    assert [a["action"] for a in found] == ["record mismatch"] and "'x1'" in found[0]["detail"]
    recover(root)
    assert actions(root, "x2") == ["record mismatch", "record mismatch"], "reported until a person fixes it"
    assert root.queued_path("x2").exists() and not list(root.rejected_dir.glob("x2*")), "its file stays"
    assert not cycle.claimable(root, root.queued_path("x2"), time.time()), "and is never claimed"
    assert root.record_path("x1").read_bytes() == x1_record and actions(root, "x1") == []
    with pytest.raises(RecordMismatch):
        queue.retry(root, "x2", by="ana")


def test_a_backoff_beyond_the_cap_is_clamped_and_one_within_it_is_kept(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.enqueue(root, "q1", shell_task())
    now = time.time()
    rec = queue.get_record(root, "q1")
    fsutil.atomic_write(root.record_path("q1"), rec.model_copy(update={"not_before": now + 30}).to_json())
    recover(root)
    recover(root)  # the second pass: from the cache
    assert actions(root, "q1") == [] and queue.get_record(root, "q1").not_before == now + 30
    # The clock steps back an hour: the same record (the cache vouches for its bytes) now holds a
    # backoff an hour and 30 s long, which no backoff is.
    monkeypatch.setattr(time, "time", lambda: now - 3600)
    recover(root)
    assert actions(root, "q1") == ["backoff clamped"]
    assert queue.get_record(root, "q1").not_before == now - 3600 + retry.INFRA.cap
    recover(root)
    assert actions(root, "q1") == ["backoff clamped"], "clamped once"
    assert root.queued_path("q1").exists()


def test_retry_is_a_recorded_decision_and_refused_while_recovery_is_pending(root: Root) -> None:
    c = started(root)
    assert queue.win(c, "reaped")
    queue.set_status(root, "t1", S.needs_human, error=ErrorInfo(kind="interrupted", message="x"))
    with pytest.raises(InvalidTransition):
        queue.retry(root, "t1", by="ana")
    c.tombstone("reaped").unlink()
    rec = queue.retry(root, "t1", by="ana", reason="flaky host")
    assert rec.status == S.queued and rec.decision and rec.decision.by == "ana"
    assert rec.container is None and not rec.container_started, "a queued record is clean"
    assert root.queued_path("t1").exists()
    with pytest.raises(InvalidTransition):
        queue.retry(root, "t1", by="ana")


def test_status_shows_a_gone_workers_claim_and_only_recovery_with_docker_decides_it(root: Root) -> None:
    started(root, worker=f"{lease.this_host()}-999999-dead")  # this host, no lock: gone
    runner = CliRunner()
    res = runner.invoke(app, ["status", "--root", str(root.path), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["counts"]["running"] == 1 and d["running"][0]["id"] == "t1"
    assert d["stale_claims"] and "gone" in d["stale_claims"][0]["stale"]
    res = runner.invoke(app, ["recover", "--root", str(root.path), "--no-docker", "--json"])
    assert res.exit_code == 0, res.output
    assert {"reaped", "undecided"} <= {a["action"] for a in json.loads(res.output)["actions"]}
    assert queue.get_record(root, "t1").status == S.running, "--no-docker decides no started task"
    res = runner.invoke(app, ["retry", "t1", "--root", str(root.path), "--by", "ana"])
    assert res.exit_code != 0, "nobody decides while its container may exist"
    recover(root)  # Docker answers: no container left
    assert queue.get_record(root, "t1").status == S.needs_human
    res = runner.invoke(app, ["retry", "t1", "--root", str(root.path), "--by", "ana"])
    assert res.exit_code == 0, res.output
    assert queue.get_record(root, "t1").status == S.queued


def test_a_killed_recovery_that_had_decided_leaves_no_duplicate_behind(root: Root) -> None:
    c = started(root)
    assert queue.win(c, "reaped")
    queue.set_status(root, "t1", S.needs_human, error=ErrorInfo(kind="interrupted", message="x"))
    recover(root, alive=ALIVE)  # the tombstone of a decided claim is only tidied
    assert not queue.claim_files(root, "t1") and not list(root.rejected_dir.glob("t1*"))
    assert queue.get_record(root, "t1").status == S.needs_human


def test_a_result_of_an_earlier_attempt_is_never_published_over_a_later_one(root: Root) -> None:
    c = started(root)
    assert queue.win(c, "done")
    rec = queue.finish_done(root, c, S.needs_review, {"patch_path": "p", "patch_sha256": "0"}, attempt=2)
    assert rec is not None and rec.status == S.running, "attempt 1 is running, not 2"
    rec = queue.finish_done(root, c, S.needs_review, {"patch_path": "p", "patch_sha256": "0"}, attempt=1)
    assert rec is not None and rec.status == S.needs_review


@pytest.mark.parametrize("docker", ["off", "removal fails"])
def test_a_started_task_is_never_decided_while_its_container_may_still_exist(root: Root, docker: str) -> None:
    # A frozen worker's container, created and marked started: the worker may wake up and start
    # it. Recovery that cannot make sure it is gone must not decide (a person would then
    # reject or retry while the engine runs).
    c = started(root)
    engine = fake_backend(root)
    box = engine.leave("t1", root=str(root.path), worker="w1", status="created")
    if docker == "off":
        rep = recovery.recover(root, docker=False, alive=GONE, ttl=60)
    else:
        engine.stuck = "removal failed (injected)"
        rep = recover(root, backend=engine)
    assert queue.get_record(root, "t1").status == S.running
    assert c.tombstone("reaped").exists(), "the tombstone fences the worker and blocks retry"
    assert "undecided" in [a.action for a in rep.actions]
    with pytest.raises(InvalidTransition):
        queue.set_status(root, "t1", S.rejected, expect={S.needs_human, S.failed})
    with pytest.raises(InvalidTransition):
        queue.retry(root, "t1", by="ana")
    engine.stuck = None
    recover(root, backend=engine)  # a later pass, the engine answers: removed first, then decided
    assert engine.removed == [box.id]
    rec = queue.get_record(root, "t1")
    assert rec.status == S.needs_human and not queue.claim_files(root, "t1")
    assert rec.diagnosis and "found and removed" in rec.diagnosis


def test_a_running_record_without_a_claim_is_not_decided_while_its_container_may_exist(root: Root) -> None:
    c = started(root)
    c.path.unlink()
    recovery.recover(root, docker=False, alive=ALIVE, ttl=60)
    assert queue.get_record(root, "t1").status == S.running
    recover(root, alive=ALIVE)
    assert queue.get_record(root, "t1").status == S.needs_human


def test_the_container_sweep_never_removes_the_container_of_a_claim_it_did_not_reap(root: Root) -> None:
    c = started(root)
    engine, here = fake_backend(root), str(root.path)
    mine = engine.leave("t1", root=here, worker="w1")
    orphan = engine.leave("t2", root=here, worker="w9")
    zombie = engine.leave("t1", root=here, worker="w0")  # an older claim's
    calls: list[str] = []

    def alive_then_gone(_w: str) -> lease.Liveness:
        # Fresh while claims are settled, stale by the time containers are swept (a lease that
        # expires between the two, or a freshly claimed file that still has its old mtime).
        calls.append(_w)
        return "alive" if len(calls) == 1 else "gone"

    recover(root, alive=alive_then_gone, backend=engine)
    assert sorted(engine.removed) == sorted([orphan.id, zombie.id]), "only containers no claim accounts for"
    assert engine.find(root=here) == [mine]
    assert c.path.exists() and queue.get_record(root, "t1").status == S.running


def test_a_status_change_whose_event_was_lost_is_logged_by_recovery(root: Root) -> None:
    c = begun(root)
    # A crash between the record write and its event: write the record as set_status would,
    # without the event.
    rec = queue.get_record(root, "t1")
    rec = rec.model_copy(
        update={
            "status": S.needs_human,
            "error": ErrorInfo(kind=ErrorKind.interrupted, message="x"),
            "attempts": [
                rec.attempts[-1].model_copy(update={"ended_at": "2026-01-01T00:00:00Z", "outcome": "lost"})
            ],
        }
    )
    fsutil.atomic_write(root.record_path("t1"), rec.to_json())
    c.path.unlink()
    recover(root)
    ev = [e for e in queue.read_events(root, "t1") if e.get("action") == "event lost"]
    assert len(ev) == 1 and ev[0]["from"] == "running" and ev[0]["to"] == "needs_human"
    recover(root)
    assert len([e for e in queue.read_events(root, "t1") if e.get("action") == "event lost"]) == 1
    queue.enqueue(root, "t2", shell_task())
    recover(root)
    assert "event lost" not in actions(root, "t2"), "a complete log is left alone"
