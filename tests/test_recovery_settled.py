"""Recovery over a long history: a pass reads again only the tasks whose record or event log
changed since a pass found them settled, and still finds every leftover a crash or a person
makes after that (files only, no Docker)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fila import fsutil, queue, recovery
from fila.backends.docker import DockerBackend
from fila.layout import Root
from fila.models import ErrorInfo, ErrorKind, Status

from .helpers import FakeDocker, make_root, shell_task

S = Status


@pytest.fixture
def root(tmp_path: Path) -> Root:
    r = make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    return r.require()


def recover(root: Root) -> recovery.Report:
    return recovery.recover(root, backend=DockerBackend(FakeDocker()), alive=lambda _w: "alive", ttl=60)


def actions(root: Root, tid: str) -> list[str]:
    return [e["action"] for e in queue.read_events(root, tid) if e["event"] == "recovered" and "action" in e]


def failed(root: Root, tid: str) -> None:
    """A finished task: queued, then failed (as a task refused when claimed)."""
    queue.enqueue(root, tid, shell_task())
    root.queued_path(tid).unlink()
    queue.set_status(root, tid, S.failed, error=ErrorInfo(kind=ErrorKind.invalid, message="x"))


def claimed(root: Root, tid: str) -> queue.Claim:
    queue.enqueue(root, tid, shell_task())
    c = queue.try_claim(root, root.queued_path(tid), "w1")
    assert c is not None
    queue.begin(root, c, shell_task().model_copy(update={"id": tid}))
    return c


def reads_during(root: Root, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One recovery pass; the ids whose record it parsed."""
    read: list[str] = []
    real = queue.read_record

    def counting(r: Root, tid: str):
        read.append(tid)
        return real(r, tid)

    with monkeypatch.context() as m:
        m.setattr(queue, "read_record", counting)
        recover(root)
    return read


def test_a_pass_reads_again_only_the_records_that_changed_since_the_last(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(30):
        failed(root, f"h{i:02d}")
    queue.enqueue(root, "q1", shell_task())  # queued, its file in fila/in/
    claimed(root, "r1")  # running, its claim held by a live worker
    assert sorted(reads_during(root, monkeypatch)) == sorted([f"h{i:02d}" for i in range(30)] + ["q1", "r1"])
    assert reads_during(root, monkeypatch) == [], "nothing changed: nothing is read"
    queue.retry(root, "h07", by="tester")  # a person's decision rewrites one record
    assert reads_during(root, monkeypatch) == ["h07"]
    assert reads_during(root, monkeypatch) == []
    # A cache that cannot be read costs one full pass, nothing else.
    (root.state_dir / "recovery.settled.json").write_text("{not json")
    assert len(reads_during(root, monkeypatch)) == 32
    assert reads_during(root, monkeypatch) == []


def _second_copy(root: Root) -> str:
    root.queued_path("t1").write_text(queue.task_json(shell_task().model_copy(update={"id": "t1"})))
    return "duplicate kept aside"


def _file_lost(root: Root) -> str:
    root.queued_path("t1").unlink()  # a queued task's file gone (a person, a broken disk)
    return "file restored"


def _event_lost(root: Root) -> str:
    # A crash between a record write and its event (a person's reject, say): the record says
    # rejected, the log's last status change still says failed.
    rec = queue.get_record(root, "t1")
    fsutil.atomic_write(root.record_path("t1"), rec.model_copy(update={"status": S.rejected}).to_json())
    return "event lost"


def _claim_lost(root: Root) -> str:
    for p in queue.claim_files(root, "t1"):
        p.unlink()  # a running task whose claim vanished: its container had not started
    return "requeued"


@pytest.mark.parametrize(
    ("make", "leftover"),
    [
        pytest.param(failed, _second_copy, id="final record, second copy in fila/in"),
        pytest.param(lambda r, t: queue.enqueue(r, t, shell_task()), _file_lost, id="queued, file lost"),
        pytest.param(failed, _event_lost, id="status change without its event"),
        pytest.param(claimed, _claim_lost, id="running, claim lost"),
    ],
)
def test_a_task_a_pass_found_settled_is_still_settled_when_a_crash_or_a_person_leaves_something(
    root: Root, make: Callable[[Root, str], object], leftover: Callable[[Root], str]
) -> None:
    make(root, "t1")
    before = queue.get_record(root, "t1").status
    recover(root)
    recover(root)
    assert actions(root, "t1") == [], "settled: nothing to do, twice"
    assert json.loads((root.state_dir / "recovery.settled.json").read_text())["entries"]["t1"][0] == before
    action = leftover(root)
    recover(root)
    assert actions(root, "t1") == [action]
    recover(root)
    assert actions(root, "t1") == [action], "settled once"
