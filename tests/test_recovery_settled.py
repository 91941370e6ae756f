"""Recovery over a long history: a pass reads again only the tasks whose record or event log
changed since a pass found them settled, and still finds every leftover a crash or a person
makes after that (files only, no Docker: the fake backend answers, with no container)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fila.core import fsutil
from fila.core.layout import Root
from fila.core.models import ErrorInfo, ErrorKind, Status
from fila.queue import store as queue
from fila.recovery import recover as recovery
from tests.support.project import fake_backend, shell_task

S = Status


def recover(root: Root) -> recovery.Report:
    return recovery.recover(root, backend=fake_backend(root), alive=lambda _w: "alive", ttl=60)


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
    recover(root)
    recover(root)
    assert actions(root, "t1") == [], "settled: nothing to do, twice"
    assert "t1" in json.loads((root.state_dir / "recovery.settled.json").read_text())["entries"]
    action = leftover(root)
    recover(root)
    assert actions(root, "t1") == [action]
    recover(root)
    assert actions(root, "t1") == [action], "settled once"


# -- the cache is only a hint ------------------------------------------------------------------


def cache_path(root: Root) -> Path:
    return root.state_dir / "recovery.settled.json"


def settled_history(root: Root, monkeypatch: pytest.MonkeyPatch) -> dict:
    """t1 finished, q1 queued, both noted by a pass; the next pass reads nothing (the cache
    works). Returns the cache as that pass left it."""
    failed(root, "t1")
    queue.enqueue(root, "q1", shell_task())
    assert sorted(reads_during(root, monkeypatch)) == ["q1", "t1"]
    assert reads_during(root, monkeypatch) == [], "a cache of the right shape is used"
    return json.loads(cache_path(root).read_text())


def _entries(**bad: object) -> Callable[[dict], str]:
    return lambda good: json.dumps({**good, "entries": {**good["entries"], **bad}})


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(_entries(t1=5, q1=5), id="an entry is a number"),
        pytest.param(_entries(t1=[], q1=[]), id="an entry is an empty list"),
        pytest.param(_entries(t1=None, q1={"a": 1}), id="null and an object"),
        pytest.param(_entries(t1=["0" * 63, None], q1=["g" * 64, None]), id="not a sha256"),
        pytest.param(
            lambda g: _entries(t1=[g["entries"]["t1"][0], [1, 2]], q1=[g["entries"]["q1"][0]])(g),
            id="a log of the wrong length, no log",
        ),
        pytest.param(
            lambda g: _entries(
                t1=[g["entries"]["t1"][0], [1, 2, 3, True]], q1=[g["entries"]["q1"][0], [1, 2, 3, -4]]
            )(g),
            id="a bool and a negative number in the log",
        ),
        pytest.param(
            lambda g: _entries(t1=["failed", *g["entries"]["t1"]], q1=["queued", *g["entries"]["q1"]])(g),
            id="an entry stating a status (the old shape)",
        ),
        pytest.param(lambda g: json.dumps({**g, "v": 1}), id="another version"),
        pytest.param(lambda g: json.dumps([g]), id="a list at the top"),
        pytest.param(lambda g: json.dumps({**g, "entries": [1]}), id="entries a list"),
        pytest.param(lambda g: "[" * 100_000 + "]" * 100_000, id="nested deeper than the parser recurses"),
        pytest.param(lambda g: '{"v": 2, "entries": {"t1": ' + "9" * 5000 + "}}", id="a 5,000-digit number"),
    ],
)
def test_a_cache_that_parses_but_has_another_shape_is_a_miss_and_the_pass_settles_everything(
    root: Root, monkeypatch: pytest.MonkeyPatch, forge: Callable[[dict], str]
) -> None:
    good = settled_history(root, monkeypatch)
    cache_path(root).write_text(forge(good))
    root.queued_path("q1").unlink()  # a queued task's file lost meanwhile: only a pass restores it
    assert sorted(reads_during(root, monkeypatch)) == ["q1", "t1"], "no exception: every entry a miss"
    assert actions(root, "q1") == ["file restored"] and root.queued_path("q1").exists()
    assert "t1" not in reads_during(root, monkeypatch), "the pass wrote a cache of its own again"
    assert reads_during(root, monkeypatch) == []


def test_a_cache_entry_never_vouches_for_a_status_the_record_does_not_have(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged entry (whoever can write fila/state/) names the record's exact bytes and log:
    the status that decides what must be around the record is read from those bytes."""

    def forged(tid: str) -> list:
        st = root.events_path(tid).lstat()
        digest = hashlib.sha256(root.record_path(tid).read_bytes()).hexdigest()
        return [digest, [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]]

    claimed(root, "r1")  # running, its claim held
    recover(root)
    cache_path(root).write_text(json.dumps({"v": 2, "entries": {"r1": forged("r1")}}))
    assert reads_during(root, monkeypatch) == [], "an entry agreeing with the files is used"
    for p in queue.claim_files(root, "r1"):
        p.unlink()  # the claim gone: a running record without one is requeued by a full pass
    cache_path(root).write_text(json.dumps({"v": 2, "entries": {"r1": forged("r1")}}))
    assert reads_during(root, monkeypatch) == ["r1"]
    assert actions(root, "r1") == ["requeued"] and queue.get_record(root, "r1").status == S.queued


def test_an_event_log_edited_in_place_with_the_same_size_and_mtime_is_read_again(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed(root, "t1")
    recover(root)
    recover(root)
    assert actions(root, "t1") == [], "the untouched log: nothing to do, twice"
    log = root.events_path("t1")
    st = log.lstat()
    data = log.read_bytes()
    at = data.rindex(b'"to": "failed"')
    assert len(data) == st.st_size
    time.sleep(0.01)  # past a coarse timestamp tick (kernels without multigrain timestamps)
    with open(log, "r+b") as f:  # in place: same inode, same size, mtime put back
        f.seek(at)
        f.write(b'"to": "faile "')
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (log.lstat().st_ino, log.lstat().st_size, log.lstat().st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    assert reads_during(root, monkeypatch) == ["t1"]
    assert actions(root, "t1") == ["event lost"]


def test_the_cache_is_never_written_or_read_through_a_link(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = settled_history(root, monkeypatch)
    victim = root.path / "victim.txt"
    victim.write_text("precious\n")
    # Every name the old writer used (its pid is known) and the cache's own name, as links.
    planted = root.state_dir / f".recovery.settled.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    cache_path(root).unlink()
    (root.path / "cache.json").write_text(json.dumps(good))
    cache_path(root).symlink_to(root.path / "cache.json")
    rep = recover(root)
    assert [a.action for a in rep.actions if a.task_id is None] == ["cache ignored"]
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert not cache_path(root).is_symlink() and cache_path(root).is_file()
    assert reads_during(root, monkeypatch) == [], "its own cache, written in place of the link, is used"


@pytest.mark.parametrize("how", ["writable by group and others", "another owner", "a FIFO"])
def test_a_cache_fila_did_not_write_alone_is_ignored(
    root: Root, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    settled_history(root, monkeypatch)
    path = cache_path(root)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.stat().st_uid == os.geteuid()
    if how == "writable by group and others":
        path.chmod(0o666)
    elif how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file away")
        os.chown(path, 4242, -1)
    else:
        path.unlink()
        os.mkfifo(path)  # opened without O_NONBLOCK, this would wait for a writer forever
    rep = recover(root)
    assert [a.action for a in rep.actions if a.task_id is None] == ["cache ignored"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.stat().st_uid == os.geteuid()
    assert stat.S_ISREG(path.stat().st_mode)
    assert reads_during(root, monkeypatch) == [], "replaced by a cache of its own"
