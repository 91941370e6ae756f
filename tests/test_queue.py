"""The file queue and its state machine, without Docker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fila.core.errors import DuplicateId, InvalidId, InvalidTransition
from fila.core.layout import Root
from fila.core.models import Status
from fila.queue import store as queue
from tests.support.cli import CLI
from tests.support.project import shell_task


def test_enqueue_writes_record_and_task_file(root: Root) -> None:
    rec = queue.enqueue(root, "t1", shell_task())
    assert rec.status == Status.queued
    assert json.loads(root.queued_path("t1").read_text())["id"] == "t1"
    assert queue.get_record(root, "t1").task.command == "true"
    assert [e["event"] for e in queue.read_events(root, "t1")] == ["submitted"]


def test_duplicate_id_is_refused_wherever_it_lives(root: Root) -> None:
    queue.enqueue(root, "dup", shell_task())
    with pytest.raises(DuplicateId):
        queue.enqueue(root, "dup", shell_task())
    root.job_dir("other").mkdir(parents=True)
    with pytest.raises(DuplicateId):
        queue.enqueue(root, "other", shell_task())


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "../x", "", "x" * 129, "a b", "é", "a\nb"])
def test_path_tricks_in_ids_are_refused(root: Root, bad: str) -> None:
    with pytest.raises(InvalidId):
        root.record_path(bad)


def test_claim_is_exclusive_and_hands_back(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    src = root.queued_path("t1")
    c1 = queue.try_claim(root, src, "w1")
    assert c1 is not None and c1.path.exists()
    assert queue.try_claim(root, src, "w2") is None
    assert queue.hand_back(root, c1)
    assert src.exists() and not c1.path.exists()
    assert not queue.hand_back(root, c1), "a lease that is gone cannot be handed back"


def test_completion_and_reaping_race_on_one_rename(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    c = queue.try_claim(root, root.queued_path("t1"), "w1")
    assert c is not None
    assert queue.win(c, "reaped")
    assert not queue.win(c, "done"), "the loser must not publish"
    assert not queue.heartbeat(c)


def test_only_the_state_machines_transitions_are_written_each_as_an_event(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task())
    with pytest.raises(InvalidTransition):
        queue.set_status(root, "t1", Status.applied)
    with pytest.raises(InvalidTransition):
        queue.set_status(root, "t1", Status.running, expect={Status.needs_review})
    assert queue.get_record(root, "t1").status == Status.queued
    queue.set_status(root, "t1", Status.running, worker="w")
    queue.set_status(root, "t1", Status.needs_review)
    queue.set_status(root, "t1", Status.applied)
    for to in Status:
        with pytest.raises(InvalidTransition):
            queue.set_status(root, "t1", to)
    events = [(e.get("from"), e.get("to")) for e in queue.read_events(root, "t1")]
    assert events[-1] == ("needs_review", "applied")


def test_reject_file_keeps_the_file_and_the_reason(root: Root) -> None:
    bad = root.in_dir / "junk.json"
    bad.write_text("{not json")
    kept = queue.reject_file(root, bad, "malformed JSON")
    assert kept.read_text() == "{not json"
    assert kept.with_name(kept.name + ".reason").read_text() == "malformed JSON\n"
    bad.write_text("{again")
    kept2 = queue.reject_file(root, bad, "again")
    assert kept2 != kept and kept.exists() and kept2.exists()


WORKER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from fila.queue import store as queue
    from fila.core.layout import Root
    root = Root.at(sys.argv[1]); me = sys.argv[2]; got = []
    # Start together: every worker has paid its imports before any claims (else the first one up
    # may drain the queue alone and the competition is not tested).
    Path(sys.argv[3] + ".ready").touch()
    while not Path(sys.argv[3]).parent.joinpath("go").exists():
        time.sleep(0.005)
    while True:
        files = queue.queued_files(root)
        if not files:
            break
        for f in files:
            c = queue.try_claim(root, f, me)
            if c:
                got.append(c.task_id)
    Path(sys.argv[3]).write_text(json.dumps(got))
""")


def test_several_worker_processes_claim_each_task_exactly_once(root: Root, tmp_path: Path) -> None:
    ids = [f"t{i:03d}" for i in range(300)]
    for i in ids:
        queue.enqueue(root, i, shell_task())
    procs, outs = [], []
    for n in range(4):
        out = tmp_path / f"w{n}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(root.path), f"w{n}", out]))
    deadline = time.monotonic() + 60
    while not all(out.with_name(out.name + ".ready").exists() for out in outs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a worker never started"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    claimed = [t for out in outs for t in json.loads(out.read_text())]
    assert sorted(claimed) == ids, "every task claimed once, none twice, none lost"
    assert sum(1 for out in outs if json.loads(out.read_text())) >= 2, "workers really competed"


def test_several_fila_worker_processes_run_each_task_exactly_once(root: Root, tmp_path: Path) -> None:
    """The whole worker (claim, job directory, run, diff, record) in three processes with two slots
    each, on the fake backend: runs are counted from the backend's own event log, one line per
    start, not from fila's records, so a second run that fila failed to record would be seen."""
    from fila.core.models import Task
    from fila.run.intake import submit as do_submit
    from fila.sandbox.fake import FakeBackend

    n = 200
    for i in range(n):  # through the library: 200 CLI start-ups would dominate the test
        do_submit(
            root, Task(id=f"t{i:03d}", engine="shell", command="echo x > out.txt", targets=["greeting.txt"])
        )
    boxes = tmp_path / "boxes"
    env = {**os.environ, "FILA_ROOT": str(root.path), "FILA_BACKEND": "fake", "FILA_FAKE_DIR": str(boxes)}
    logs = [tmp_path / f"w{k}.log" for k in range(3)]
    procs = []
    for log in logs:
        with open(log, "wb") as out:
            cmd = [*CLI, "worker", "--once", "--concurrency", "2"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=out))
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in logs]
    recs = queue.all_records(root)
    assert len(recs) == n and all(r.status == Status.needs_review and r.attempt == 1 for r in recs)
    assert all("+x" in (root.path / r.patch_path).read_text() for r in recs if r.patch_path)
    by_worker: dict[str, int] = {}
    for r in recs:
        (a,) = r.attempts
        by_worker[a.worker or ""] = by_worker.get(a.worker or "", 0) + 1
    assert len(by_worker) == 3, f"every worker took a share: {by_worker}"
    started = [e["job"] for e in FakeBackend(boxes).events() if e["event"] == "start"]
    assert sorted(started) == sorted(r.id for r in recs), "each task's box started exactly once"
    assert FakeBackend(boxes).find(root=str(root.path)) == [], "no box left"


def test_a_claim_starts_with_a_fresh_heartbeat(root: Root) -> None:
    queue.enqueue(root, "old", shell_task())
    src = root.queued_path("old")
    os.utime(src, (1_000_000, 1_000_000))  # waited in the queue for decades
    c = queue.try_claim(root, src, "w1")
    assert c is not None and time.time() - c.path.stat().st_mtime < 60


def test_hand_back_never_replaces_a_file_dropped_meanwhile(root: Root) -> None:
    queue.enqueue(root, "t1", shell_task("echo one"))
    c = queue.try_claim(root, root.queued_path("t1"), "w1")
    assert c is not None
    root.queued_path("t1").write_text('{"engine": "shell", "command": "echo two"}')
    assert queue.hand_back(root, c)
    assert "echo one" in root.queued_path("t1").read_text()
    kept = list(root.rejected_dir.glob("t1*.json"))
    assert len(kept) == 1 and "echo two" in kept[0].read_text()


def test_rename_noreplace_refuses_to_replace(tmp_path: Path) -> None:
    from fila.core.fsutil import rename_noreplace

    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_text() == "b" and (tmp_path / "a").exists()
    rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c").read_text() == "a" and not (tmp_path / "a").exists()


def test_a_short_append_is_undone_and_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fila.core import fsutil

    log = tmp_path / "events"
    fsutil.append_line(log, "first")
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, data[:3]))
    with pytest.raises(OSError):
        fsutil.append_line(log, "second-line")
    monkeypatch.undo()
    fsutil.append_line(log, "third")
    assert log.read_text() == "first\nthird\n"


@pytest.mark.parametrize("ttl", ["0", "-5", "1", "nan", "soon"])
def test_a_lease_ttl_that_would_reap_live_workers_is_refused(
    ttl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import InvalidInput
    from fila.queue.lease import lease_ttl

    monkeypatch.setenv("FILA_LEASE_TTL", ttl)
    with pytest.raises(InvalidInput):
        lease_ttl()


def test_a_job_waits_out_a_passing_holder_of_its_lock_and_not_a_stalled_one(root: Root) -> None:
    import threading

    from fila.core.errors import InfraError
    from fila.queue import lease

    def hold(seconds: float, taken: threading.Event, letting_go: threading.Event) -> None:
        with lease.try_job_lock(root, "t1") as held:
            assert held
            taken.set()
            time.sleep(seconds)
            letting_go.set()  # still held here: whoever gets the lock gets it after this

    # Allowed: a recovery pass holds the lock for a moment; the job gets it once it is free.
    taken, letting_go = threading.Event(), threading.Event()
    passing = threading.Thread(target=hold, args=(0.5, taken, letting_go))
    passing.start()
    assert taken.wait(5)
    with lease.job_lock(root, "t1", wait_s=10):
        assert letting_go.is_set(), "the lock came only after the holder let go"
    passing.join()
    # A holder that stays past the wait is a stalled worker: the job is refused, as infra.
    taken, letting_go = threading.Event(), threading.Event()
    stalled = threading.Thread(target=hold, args=(2.0, taken, letting_go))
    stalled.start()
    assert taken.wait(5)
    with pytest.raises(InfraError, match="still in use"), lease.job_lock(root, "t1", wait_s=0.3):
        pass
    assert not letting_go.is_set(), "refused while the holder still held it"
    stalled.join()
