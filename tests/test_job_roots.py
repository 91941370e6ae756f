"""A PostgreSQL runner's job roots on its disk (recovery/remote_jobs.py, docs/scale-out.md "Running
it"): recovery removes a job root whose runner is gone, and nothing it did not make, whatever is
planted in `remote/` (links, directories and files named like its locks and temp files, a job root
whose fila/ links to a root's own queue); only on a root marked as a runner's; never blocking.
`take` refuses what it cannot own with an InfraError, removes only what it made, and a root other
users can write, or whose own directories link out; a removal stopped part-way is finished; what
git could carry (0755 directories, 0644 files) is never a runner's, and what has no lock is said
by its path. A runner root's recovery lock is its user's and waited for within a bound. What a
runner publishes names no place of this host, cut only after it is redacted; a log cut short does
not name its own path. The lease of a claim counts from when the claim was sent. No container
and no database: the fake backend, plain files.

Cost in the default run: about 2 s (a `fila recover` in this process, one short child process,
a 0.2 s bounded wait)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fila.core.errors import InfraError
from fila.core.layout import Root
from fila.core.models import Task
from fila.queue import store as queue
from fila.recovery import remote_jobs, runner_root
from fila.recovery.base import Report
from fila.recovery.recover import recover, recover_job_roots
from fila.run import job as cycle
from fila.sandbox.fake import FakeBackend
from tests.support.pg_runner import fila
from tests.support.project import make_root


def job_root(runner: Root, fake: FakeBackend, name: str) -> Path:
    """A job root as a runner that died left it: made by `take`, laid out, a box of it still
    there, its lock let go (as the kernel lets go a killed process's)."""
    held = remote_jobs.take(runner, name)
    jr = Root(held.path).create()
    fake.leave(name.split(".")[0], root=str(jr.path), worker="h1")
    held.release()
    return jr.path


def in_time(fn: Callable[[], Report], timeout: float = 10.0) -> Report:
    """`fn()` in a thread: it must return within `timeout` (a recovery never blocks)."""
    out: list[Report] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the recovery blocked"
    return out[0]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_free_job_root_is_recovered_and_nothing_planted_beside_it_is_touched(tmp_path: Path) -> None:
    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    remote = runner_root.jobs_dir(runner)
    # A live claim of the runner root's own queue: no job root's recovery may settle it.
    (runner.path / "greeting.txt").write_text("hi\n")
    queue.enqueue(runner, "t1", Task(engine="shell", targets=["greeting.txt"], command="sleep 100"))
    claim = cycle.next_claim(runner, "w-live")
    assert claim is not None

    # The allowed counterpart first: a genuine job root whose runner is gone goes, with its box.
    gone = job_root(runner, fake, "g.1")
    rep = in_time(lambda: recover_job_roots(runner, backend=fake))
    assert [a.action for a in rep.actions] == ["job root removed"], rep.to_dict()
    assert not gone.exists() and fake.find() == [] and listing(remote) == []

    # Planted: names like its temp files and locks that are directories, links, a FIFO; a
    # project's own directory beside an empty lock; one beside a lock holding a mark its
    # directory lacks; a job root whose fila/ links to the root's own queue, the lock's mark
    # written there; a temp lock of a live process (this one).
    outside = tmp_path / "outside"
    outside.write_text("not fila's")
    (remote / ".notes.tmp").mkdir()
    os.symlink(outside, remote / ".x.tmp")
    (remote / ".draft.tmp").write_text("a project's")
    os.mkfifo(remote / ".pipe.tmp")
    os.symlink(outside, remote / ".l.1.lock")
    (remote / ".d.1.lock").mkdir()
    (remote / "v1.2" / "src").mkdir(parents=True)
    (remote / ".v1.2.lock").write_text("")
    (remote / "v1.3" / "src").mkdir(parents=True)
    (remote / ".v1.3.lock").write_text("ab" * 16)
    (remote / "x.5").mkdir()
    os.symlink("../../fila", remote / "x.5" / "fila")
    (remote / ".x.5.lock").write_text("cd" * 16)
    (runner.state_dir / remote_jobs.PROOF).write_text("cd" * 16)
    for lock in (".v1.2.lock", ".v1.3.lock", ".x.5.lock"):  # as a runner makes its locks: 0600
        (remote / lock).chmod(0o600)
    live_temp = remote / f".t.8.lock.{os.getpid()}.1.tmp"
    live_temp.write_text("")
    planted = listing(remote)
    dead_temp = remote / f".t.9.lock.{dead_pid()}.1.tmp"  # a taker that is gone: its temp goes
    dead_temp.write_text("")
    gone = job_root(runner, fake, "g.2")  # and a genuine one among them, still recovered

    rep = in_time(lambda: recover(runner, backend=fake, alive=lambda _w: "alive"))
    removed = [a.detail for a in rep.actions if a.action == "job root removed"]
    assert removed and all(d.startswith(f"{gone}:") for d in removed), rep.to_dict()
    kept = " ".join(a.detail for a in rep.actions if a.action == "job root kept")
    for name in (".l.1.lock", ".d.1.lock", ".v1.2.lock", "v1.3", "x.5"):
        assert f"{remote / name}" in kept, (name, kept)
    assert listing(remote) == planted and fake.find() == [] and outside.read_text() == "not fila's"
    assert [c.name for c, _ in queue.claims(runner)] == [claim.name]
    assert queue.get_record(runner, "t1").status == "queued"
    # `fila recover --root` there exits cleanly, quickly, and says what it kept.
    t0 = time.monotonic()
    res = fila(
        "recover",
        "--root",
        str(runner.path),
        env={"FILA_BACKEND": "fake", "FILA_FAKE_DIR": str(tmp_path / "boxes")},
    )
    assert res.exit_code == 0 and "v1.3" in res.output, res.output
    assert time.monotonic() - t0 < 10 and listing(remote) == planted


def test_only_a_root_marked_as_a_runners_gets_the_job_root_pass(tmp_path: Path) -> None:
    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    jr = job_root(runner, fake, "a.1")
    mark = runner.state_dir / runner_root.MARK
    assert mark.is_file()  # `take` marks its root, as `fila worker --queue` does at its start
    mark.unlink()  # a file queue root or a project: its remote/ is its own
    assert recover(runner, backend=fake).actions == [] and jr.is_dir() and len(fake.find()) == 1
    runner_root.mark(runner)
    assert [a.action for a in recover(runner, backend=fake).actions] == ["job root removed"]
    assert not jr.exists() and fake.find() == []


def test_a_job_root_its_runner_died_making_goes_and_one_being_recovered_elsewhere_waits(
    tmp_path: Path,
) -> None:
    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    # Killed between its directories and its mark: only empty directories, removed as such.
    held = remote_jobs.take(runner, "m.1")
    (held.path / "fila" / "state" / remote_jobs.PROOF).unlink()
    held.release()
    rep = recover_job_roots(runner, backend=fake)
    assert [a.action for a in rep.actions] == ["job root removed"], rep.to_dict()
    assert listing(runner_root.jobs_dir(runner)) == []
    # A job root whose own recovery is running (its recovery lock held): kept, never waited for.
    jr = job_root(runner, fake, "r.1")
    with open(jr / "fila" / "state" / ".recovery.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rep = in_time(lambda: recover_job_roots(runner, backend=fake))
        assert [a.action for a in rep.actions] == ["job root kept"] and jr.is_dir(), rep.to_dict()
    assert [a.action for a in recover_job_roots(runner, backend=fake).actions] == ["job root removed"]


def test_take_holds_a_marked_lock_and_refuses_what_it_cannot_own(tmp_path: Path) -> None:
    runner = make_root(tmp_path / "runner")
    held = remote_jobs.take(runner, "t.1")
    mark = held.lock.read_text()
    assert (held.path / "fila" / "state" / remote_jobs.PROOF).read_text() == mark and len(mark) == 32
    assert oct(held.path.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(InfraError, match="exists already"):
        remote_jobs.take(runner, "t.1")
    shutil.rmtree(held.path)  # removed by its holder: the lock goes with it
    held.release()
    assert listing(runner_root.jobs_dir(runner)) == []
    with pytest.raises(InfraError, match="not a job root's name"):
        remote_jobs.take(runner, "../t.1")
    # remote/ a file, or a link out of the root: refused, nothing made through it.
    (runner.path / "remote").rmdir()
    (runner.path / "remote").write_text("a file")
    with pytest.raises(InfraError, match="not a directory of this user's"):
        remote_jobs.take(runner, "t.2")
    (runner.path / "remote").unlink()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", runner.path / "remote")
    with pytest.raises(InfraError, match="not a directory of this user's"):
        remote_jobs.take(runner, "t.2")
    assert listing(tmp_path / "elsewhere") == []
    rep = recover(runner, backend=FakeBackend(tmp_path / "boxes"))
    assert [a.action for a in rep.actions] == ["job root kept"], rep.to_dict()


def test_take_without_o_tmpfile_survives_its_temp_vanishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_root(tmp_path / "runner")
    remote = runner_root.jobs_dir(runner)
    # A file system without O_TMPFILE: a named temp lock. Its own temp is left to it by recovery
    # (its pid lives); one that vanishes between its open and its flock is made again.
    monkeypatch.setattr(os, "O_TMPFILE", os.O_DIRECTORY)  # open(dir, O_RDWR | O_DIRECTORY): EISDIR
    real, seen = fcntl.flock, []

    def racing(fd: int, op: int) -> None:
        if not seen:
            [temp] = [p for p in remote.iterdir() if p.name.endswith(".tmp")]
            seen.append(remote_jobs.names(runner))
            assert temp.exists()  # recovery leaves a live taker's temp alone
            temp.unlink()  # as a clearer that did not check would
        real(fd, op)

    monkeypatch.setattr(remote_jobs.fcntl, "flock", racing)
    held = remote_jobs.take(runner, "t.7")
    assert seen == [[]] and listing(remote) == [".t.7.lock", "t.7"]
    monkeypatch.undo()
    assert remote_jobs.names(runner) == ["t.7"]
    held.release()


def test_a_lease_counts_from_when_its_claim_was_sent() -> None:
    from fila.queue.pg.store import Lease
    from fila.run.lease_hooks import LeaseHooks

    task = Task(engine="shell", command="true", targets=["a"])
    lease = Lease(task_id="t", token=1, runner="h1", attempt=1, task=task, expires_at=datetime.now(UTC))
    # The allowed counterpart: a claim sent just now holds; one whose answer came a lease late does not.
    LeaseHooks(None, lease, threading.Event(), 10.0, time.monotonic()).check()  # type: ignore[arg-type]
    late = LeaseHooks(None, lease, threading.Event(), 10.0, time.monotonic() - 9.5)  # type: ignore[arg-type]
    with pytest.raises(queue.LeaseLost):
        late.check()


def test_a_runner_root_others_can_write_is_refused_and_remote_is_made_its_owners_alone(
    tmp_path: Path,
) -> None:
    runner = make_root(tmp_path / "runner")
    remote = runner_root.jobs_dir(runner)
    # The allowed counterpart: a root only its user can write; a remote/ others could reach
    # (a project's own, 0777) is tightened to 0700 at the runner's start, not refused.
    runner.path.chmod(0o755)
    remote.mkdir(exist_ok=True)
    remote.chmod(0o777)
    assert runner_root.prepare(runner) == remote and oct(remote.stat().st_mode & 0o777) == "0o700"
    remote.chmod(0o750)
    held = remote_jobs.take(runner, "t.1")
    assert oct(remote.stat().st_mode & 0o777) == "0o700"
    held.verify()  # still the directory take made
    # Swapped for another directory (or a link) after take: nothing is written there.
    held.path.rename(remote / "moved")
    held.path.mkdir()
    with pytest.raises(InfraError, match="no longer the directory this runner made"):
        held.verify()
    held.path.rmdir()
    os.symlink(remote / "moved", held.path)
    with pytest.raises(InfraError, match="no longer the directory this runner made"):
        held.verify()
    held.path.unlink()
    (remote / "moved").rename(held.path)
    held.verify()
    remote_jobs.remove(held.path)
    held.release()
    assert listing(remote) == []
    # A root group or others can write: refused, at the start and at every take.
    runner.path.chmod(0o775)
    for check in (lambda: runner_root.prepare(runner), lambda: remote_jobs.take(runner, "t.2")):
        with pytest.raises(InfraError, match="can be written by another user"):
            check()
    assert listing(remote) == []
    runner.path.chmod(0o700)


def test_take_removes_only_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_root(tmp_path / "runner")
    remote = runner_root.jobs_dir(runner)
    real = remote_jobs._make

    # A directory put at the job root's name just before take's mkdir (someone who can write
    # remote/): take refuses and leaves it, and its own lock goes.
    def racing(d: Path, name: str, nonce: str) -> tuple[int, int]:
        (d / name).mkdir()
        (d / name / "theirs.txt").write_text("not fila's")
        return real(d, name, nonce)

    monkeypatch.setattr(remote_jobs, "_make", racing)
    with pytest.raises(InfraError, match="exists without its lock"):
        remote_jobs.take(runner, "t.1")
    assert listing(remote) == ["t.1"] and (remote / "t.1" / "theirs.txt").read_text() == "not fila's"
    monkeypatch.undo()
    # Its own directory, made in part when the mark cannot be written: removed, with its lock,
    # and said as an InfraError (not an OSError).
    shutil.rmtree(remote / "t.1")

    def no_space(*_a: object, **_k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(remote_jobs.os, "fdopen", no_space)
    with pytest.raises(InfraError, match="could not be made: No space left"):
        remote_jobs.take(runner, "t.2")
    monkeypatch.undo()
    assert listing(remote) == []
    remote_jobs.take(runner, "t.3").release()  # the allowed counterpart: made, kept, its lock free
    assert listing(remote) == [".t.3.lock", "t.3"]


def test_a_removal_stopped_part_way_is_finished_and_a_mark_cut_short_is_cleared(tmp_path: Path) -> None:
    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    remote = runner_root.jobs_dir(runner)
    # The allowed counterpart: a job root removed by its holder goes, its lock with it.
    held = remote_jobs.take(runner, "a.1")
    Root(held.path).create()
    remote_jobs.remove(held.path)
    held.release()
    assert listing(remote) == []
    # A removal killed part-way, after `rm` took the mark (fila/) but not the rest: the job
    # root is under its hidden name, its lock kept by release, and the next recovery finishes it.
    held = remote_jobs.take(runner, "b.1")
    jr = Root(held.path).create()
    (jr.path / "src").mkdir()
    (jr.path / "src" / "x").write_text("x")
    os.rename(jr.path, remote_jobs.removing(jr.path))
    shutil.rmtree(remote_jobs.removing(jr.path) / "fila")
    held.release()
    assert listing(remote) == [".b.1.lock", ".b.1.removing"]
    rep = recover_job_roots(runner, backend=fake)
    assert [a.action for a in rep.actions] == ["job root removed"], rep.to_dict()
    assert listing(remote) == []
    # Killed between the mark's creation and its write: an empty mark (a proper beginning of its
    # lock's) is cleared with the empty directories; a mark that is not its lock's is kept.
    for name in ("c.1", "c.2"):
        held = remote_jobs.take(runner, name)
        nonce = held.lock.read_text()
        other = nonce[:5] + ("0" if nonce[5] != "0" else "1")  # not a beginning of it
        (held.path / "fila" / "state" / remote_jobs.PROOF).write_text("" if name == "c.1" else other)
        held.release()
    rep = recover_job_roots(runner, backend=fake)
    assert sorted(a.action for a in rep.actions) == ["job root kept", "job root removed"], rep.to_dict()
    assert listing(remote) == [".c.2.lock", "c.2"]


def test_what_a_runner_publishes_names_no_place_of_this_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.run.remote_publish import Redact

    home, runtime = tmp_path / "home" / "u", tmp_path / "run" / "user" / "0"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    runner = make_root(tmp_path / "runner")
    jr = Root(runner_root.jobs_dir(runner) / "t.1")
    r = Redact(jr, "t")
    # The allowed counterpart: a path that only begins or ends like one of them is kept.
    kept = f"{tmp_path}/srv{home} {home}2/x {runtime}.d"
    assert r.text(kept) == kept
    said = f"engine unavailable: path={runtime}/podman/podman.sock; see {home}/.config; {jr.path}/x"
    assert (
        r.text(said) == "engine unavailable: path=<runtime>/podman/podman.sock; see <home>/.config; <job>/x"
    )
    assert r.text(f"/tmp/podman-run-{os.getuid()}/podman") == "<runtime>/podman"
    # A refusal's reason is cut after it is redacted: a path across the cut is still replaced.
    from types import SimpleNamespace

    from fila.run.remote_publish import refuse

    sent: list[str] = []
    q = SimpleNamespace(publish=lambda _tid, _token, _status, f: sent.append(f["error"].message))
    lease = SimpleNamespace(task_id="t", token=1)
    why = "A" * 280 + f" {jr.path}/work/x"
    refuse(q, lease, jr, "fake", why, limit=300)  # type: ignore[arg-type]
    assert sent == ["A" * 280 + " <job>/work/x"]
    refuse(q, lease, jr, "fake", "B" * 400 + f" {jr.path}", limit=300)  # type: ignore[arg-type]
    assert sent[-1] == "B" * 300 + " [cut]" and str(runner.path) not in sent[-1]


def test_a_log_cut_short_says_so_without_naming_its_own_path(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from fila.sandbox.docker.container import cut_pump

    log = tmp_path / "t.log"
    log.write_bytes(b"out\n")
    pump = SimpleNamespace(cut_off=lambda: None, join=lambda timeout: None)
    warning = cut_pump(pump, SimpleNamespace(log_path=log))  # type: ignore[arg-type]
    text = log.read_text()
    assert text.startswith("out\n[fila: log incomplete") or text.startswith("out\n\n[fila: log incomplete")
    assert "stdout and this log may miss the end" in text and str(log) not in text
    assert str(log) in warning  # the record's warning names it (redacted when a runner publishes it)


def test_a_runner_root_whose_own_directories_link_out_or_others_can_write_is_refused(tmp_path: Path) -> None:
    # The allowed counterpart: a root of this user's; a fila/state/ others could write is
    # tightened (whoever can write there can plant and hold its recovery lock).
    runner = make_root(tmp_path / "runner")
    runner.path.chmod(0o755)
    runner.state_dir.chmod(0o777)
    assert runner_root.prepare(runner) == runner_root.jobs_dir(runner)
    assert runner.state_dir.stat().st_mode & 0o022 == 0
    # A project whose `fila` or `sandbox` links to another root: refused before anything is
    # written through the link (no mark there, no directory made or tightened there).
    victim = make_root(tmp_path / "victim")
    (victim.path / "sandbox" / "meta").chmod(0o2775)
    for part, target in (("fila", victim.fila), ("sandbox", victim.path / "sandbox")):
        proj = tmp_path / f"proj-{part}"
        shutil.copytree(runner.path, proj, symlinks=True)
        shutil.rmtree(proj / part)
        os.symlink(target, proj / part)
        with pytest.raises(InfraError, match=rf"proj-{part}/{part} is not a directory .*\(a link\)"):
            runner_root.check_root(Root(proj))
        with pytest.raises(InfraError, match="a link"):
            runner_root.prepare(Root(proj))
    assert not (victim.state_dir / runner_root.MARK).exists()
    assert oct((victim.path / "sandbox" / "meta").stat().st_mode & 0o7777) == "0o2775"


def test_the_recovery_lock_of_a_runner_root_is_its_users_and_waited_for_within_a_bound(
    tmp_path: Path,
) -> None:
    runner = make_root(tmp_path / "runner")
    runner_root.prepare(runner)
    lock = runner.state_dir / ".recovery.lock"
    # The allowed counterpart: free, it is taken; held by another open file, `wait_s` bounds the
    # wait and names the lock (a runner's start says so rather than hangs).
    assert recover_job_roots(runner, wait_s=0.2).skipped is False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(InfraError, match=f"another recovery holds {lock}"):
            recover_job_roots(runner, wait_s=0.2)
        assert time.monotonic() - t0 < 5
    finally:
        os.close(fd)
    if os.getuid() != 0:
        pytest.skip("planting another user's lock needs root (chown)")
    os.chown(lock, 4242, -1)  # planted by another user while fila/state/ was writable
    for call in (lambda: recover_job_roots(runner, wait_s=0.2), lambda: recover(runner)):
        with pytest.raises(InfraError, match=r"\.recovery\.lock is not a regular file of this user's"):
            call()


def test_what_git_could_carry_or_has_no_lock_is_kept_and_said(tmp_path: Path) -> None:
    # A checkout carrying a runner's mark, a lock and a job root whose marks match, with the modes
    # git gives them (directories 0755 under umask 022, files 0644): never a runner's job root.
    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    remote = runner_root.jobs_dir(runner)
    gone = job_root(runner, fake, "g.1")  # the allowed counterpart: a genuine one, recovered
    (remote / ".n.1.lock").write_text("ab" * 16)
    (remote / "n.1" / "fila" / "state").mkdir(parents=True)
    (remote / "n.1" / "fila" / "state" / remote_jobs.PROOF).write_text("ab" * 16)
    for lock_mode, dir_mode in ((0o644, 0o700), (0o600, 0o755)):
        (remote / ".n.1.lock").chmod(lock_mode)
        (remote / "n.1").chmod(dir_mode)
        rep = recover_job_roots(runner, backend=fake)
        kept = [a.detail for a in rep.actions if a.action == "job root kept"]
        assert (remote / "n.1").is_dir() and len(kept) == 1
        assert kept[0].startswith((f"{remote / '.n.1.lock'}:", f"{remote / 'n.1'}:")), kept
    assert not gone.exists()
    remote.chmod(0o755)  # a checkout's remote/: nothing under it is a runner's
    rep = recover_job_roots(runner, backend=fake)
    assert [a.detail.split(" ", 1)[0] for a in rep.actions] == [str(remote)]
    remote.chmod(0o700)
    # What has no lock file (a job root, the rest of a removal) is left, and said by its path.
    (remote / ".n.1.lock").unlink()
    (remote / ".m.2.removing").mkdir()
    kept = sorted(a.detail.split(":", 1)[0] for a in recover_job_roots(runner, backend=fake).actions)
    assert kept == [str(remote / "m.2"), str(remote / "n.1")]
    assert listing(remote) == [".m.2.removing", "n.1"]
