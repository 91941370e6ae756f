"""Hostile or broken input to fila itself (a swapped directory, a path past the kernel's limits, an
unreadable tree, a bad deny rule, a missing image): each attack refused or confined to its own task,
its allowed twin kept, and the next task runs."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import FilaError
from fila.queue.policy import load_policy, narrow
from fila.workspace import jobdir
from tests.support.project import make_root, shell_task

# -- 1. the copy race: a directory swapped for a symlink while fila copies ----------------------

_RACER = textwrap.dedent(
    """
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    a, b, stop = (os.fsencode(x) for x in sys.argv[1:4])
    open(sys.argv[4], "w").close()  # ready
    while not os.path.exists(stop):
        libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
    """
)


def _has_renameat2() -> bool:
    return hasattr(ctypes.CDLL(None), "renameat2")


@pytest.mark.skipif(not _has_renameat2(), reason="needs renameat2 (glibc >= 2.28)")
def test_copy_never_lands_a_file_from_outside_the_project_while_a_directory_is_swapped(
    tmp_path: Path,
) -> None:
    root = make_root(tmp_path / "proj").require()
    outside = tmp_path / "outside"
    outside.mkdir()
    d = root.path / "d"
    (d / "x").mkdir(parents=True)
    names = [f"f{i}" for i in range(8)]
    for n in names:
        (d / "x" / n).write_text("decoy\n")
        (outside / n).write_text("SECRET\n")
    os.symlink(outside, d / "y")
    policy, _ = load_policy(root, "default")
    task = shell_task(targets=["d"])
    eff = narrow(policy, task)

    # The allowed counterpart, with nothing racing: the directory's files are copied.
    prep = jobdir.prepare(root, "calm", task, policy, eff)
    for side in ("input", "work"):
        assert (prep.job_dir / side / "d" / "x" / "f0").read_text() == "decoy\n"
        assert os.readlink(prep.job_dir / side / "d" / "y") == str(outside)

    stop, ready = tmp_path / "stop", tmp_path / "ready"
    racer = subprocess.Popen(
        [sys.executable, "-c", _RACER, str(d / "x"), str(d / "y"), str(stop), str(ready)]
    )
    copied = refused = 0
    try:
        while not ready.exists():
            pass
        for i in range(400):
            try:
                prep = jobdir.prepare(root, f"race{i % 4}", task, policy, eff)
            except (FilaError, OSError):
                refused += 1  # a tree that changed under the copy: that task's failure
                continue
            for side in ("input", "work"):
                for dirpath, _dirs, files in os.walk(prep.job_dir / side):
                    for f in files:
                        p = Path(dirpath, f)
                        if not p.is_symlink():
                            assert p.read_text() == "decoy\n", f"{p} came from outside the project"
                            copied += 1
    finally:
        stop.touch()
        racer.wait(timeout=30)
    assert copied > 0, "the race left nothing to check"


# -- 8. resolve_targets keeps order and drops repeats in linear time ---------------------------


def test_many_targets_resolve_once_each_in_order(tmp_path: Path) -> None:
    root = make_root(tmp_path).require()
    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text("x\n")
    policy, _ = load_policy(root, "default")
    names = ["t2.txt", "t0.txt", "t2.txt", "./t1.txt", "t0.txt"] * 4000
    assert jobdir.resolve_targets(root, root.path, names, policy) == ["t2.txt", "t0.txt", "t1.txt"]
    with pytest.raises(FilaError):
        jobdir.resolve_targets(root, root.path, [*names, "missing.txt"], policy)


# -- 3. a project fila cannot read ends as that task's record; the other tasks run -------------


def _deep_target(base: Path, levels: int) -> str:
    """A file below `levels` directories of 253-byte names: the full path is past PATH_MAX."""
    cur = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    parts = []
    for i in range(levels):
        name = f"d{i:02d}" + "x" * 250
        os.mkdir(name, dir_fd=cur)
        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
        parts.append(name)
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cur))
    os.close(cur)
    return "/".join([*parts, "f"])


def test_a_target_path_longer_than_the_kernel_allows_is_refused_by_name_not_with_a_traceback(
    tmp_path: Path,
) -> None:
    from tests.support.cli import fila

    root = make_root(tmp_path)
    (tmp_path / "g.txt").write_text("hello\n")
    ok = fila(tmp_path, "submit", "--engine", "shell", "--command", "true", "--target", "g.txt")
    assert ok.exit_code == 0, ok.output  # the allowed counterpart
    deep = _deep_target(tmp_path, 18)
    res = fila(tmp_path, "submit", "--engine", "shell", "--command", "true", "--target", deep)
    assert res.exit_code == 2, res.output
    assert "cannot be read: File name too long" in res.output and "Traceback" not in res.output
    policy, _ = load_policy(root, "default")
    with pytest.raises(FilaError, match="File name too long"):
        jobdir.resolve_targets(root, root.path, [deep], policy)


# -- 3 and 6 as an ordinary user: an unreadable directory in the project; a chmod 000 in work/ ---


@pytest.fixture(params=["copy", "default"])
def as_user(request: pytest.FixtureRequest, shell_image: object) -> Iterator[Any]:
    """fila as a throwaway ordinary user (in the Docker group), on its own queue root; work/ a
    copy (FILA_WORKSPACE=copy) or whatever fila chooses by default."""
    if os.getuid() != 0:
        pytest.skip("creating an ordinary user for the test needs root")
    import shutil
    import tempfile

    from tests.support.users import fila_on_new_root, ordinary_user

    base = Path(tempfile.mkdtemp(prefix="fila-long-path-"))
    try:
        with ordinary_user() as user:
            yield fila_on_new_root(base, user, {"FILA_WORKSPACE": "copy"} if request.param == "copy" else {})
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _submit(f: Any, tid: str, command: str, target: str) -> None:
    res = f("submit", "--id", tid, "--engine", "shell", "--command", command, "--target", target)
    assert res.returncode == 0, res.stdout + res.stderr


def _rec(f: Any, tid: str) -> dict:
    import json

    return json.loads((f.root / "fila" / "out" / f"{tid}.json").read_text())


@pytest.mark.docker
def test_an_unreadable_directory_in_the_project_fails_its_task_once_and_the_next_task_runs(
    as_user: Any,
) -> None:
    f = as_user
    src = f.root / "src"
    (src / "locked").mkdir(parents=True)
    (src / "ok.txt").write_text("ok\n")
    import pwd

    pw = pwd.getpwnam(f.user)
    for p in (src, src / "locked", src / "ok.txt"):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    os.chmod(src / "locked", 0)
    _submit(f, "locked", "true", "src")
    _submit(f, "after", "sed -i s/hello/world/ greeting.txt", "greeting.txt")
    res = f("run", "--once")
    out = res.stdout + res.stderr
    assert "fila bug" not in out and "Traceback" not in out, out
    # The allowed counterpart: the valid task queued behind it ran to review.
    assert _rec(f, "after")["status"] == "needs_review", out
    bad = _rec(f, "locked")
    assert bad["status"] == "failed" and bad["error"]["kind"] == "invalid", bad
    assert "Permission denied" in bad["error"]["message"] and bad["attempt"] == 1, bad
    assert not list((f.root / "fila" / "in").glob("*.json"))  # nothing handed back to loop on


ENGINE_LEAVES = (
    "sed -i s/hello/world/ greeting.txt && mkdir -p .git/objects .git/refs z/.git && "
    'echo "ref: refs/heads/m" > .git/HEAD && printf "[core]\\n\\tfsmonitor = x\\n" > .git/config && '
    "echo keep > z/k && cp /bin/sh suid && chmod 4755 suid && chmod 000 z"
)


@pytest.mark.docker
def test_a_directory_the_engine_made_unreadable_does_not_stop_the_cleanup_of_work(as_user: Any) -> None:
    f = as_user
    _submit(f, "u6", ENGINE_LEAVES, "greeting.txt")
    _submit(f, "next", "true", "greeting.txt")
    res = f("run", "--once")
    out = res.stdout + res.stderr
    assert "fila bug" not in out and "Traceback" not in out, out
    rec = _rec(f, "u6")
    if f.extra_env:  # the copy this test asked for, where reclaim runs on work/ itself
        assert (rec.get("workspace") or {}).get("strategy", "copy") == "copy", rec
    # The allowed counterpart: what the engine changed is kept and reviewed.
    assert rec["status"] == "needs_review", rec
    diff = f("diff", "u6").stdout
    assert "+world" in diff and "b/z/k" in diff and "+keep" in diff, diff
    # Nothing that would run on the host is left anywhere fila keeps the engine's output (work/,
    # or an overlay's upper layer): no git metadata, no setuid or setgid file.
    for dirpath, dirs, files in os.walk(f.root / "sandbox"):
        assert ".git" not in dirs, dirpath
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            assert not st.st_mode & 0o6000, os.path.join(dirpath, name)
    assert _rec(f, "next")["status"] == "needs_review"


# -- 4. a deny rule pathspec cannot compile is a policy error naming the rule ------------------


def test_a_deny_rule_with_a_reversed_range_is_refused_by_its_index_everywhere(tmp_path: Path) -> None:
    import json

    from tests.support.cli import fila

    root = make_root(tmp_path)
    (tmp_path / "g.txt").write_text("hello\n")
    pol = json.loads((root.policies_dir / "default.json").read_text())
    n = len(pol["deny"])
    (root.policies_dir / "ranged.json").write_text(json.dumps({**pol, "deny": [*pol["deny"], "[a-z].tmp"]}))
    (root.policies_dir / "bad.json").write_text(json.dumps({**pol, "deny": [*pol["deny"], "[z-a]"]}))
    args = ("submit", "--engine", "shell", "--command", "true", "--target", "g.txt", "--policy")
    ok = fila(tmp_path, *args, "ranged")
    assert ok.exit_code == 0, ok.output  # the allowed counterpart: a range that runs low to high
    res = fila(tmp_path, *args, "bad")
    assert res.exit_code == 2, res.output
    assert f"'deny.{n}'" in res.output and "Traceback" not in res.output
    doc = fila(tmp_path, "doctor", "--no-self-test")
    assert "Traceback" not in doc.output
    line = next(ln for ln in doc.output.splitlines() if "policies" in ln and "valid:" in ln)
    valid, _, invalid = line.partition("INVALID:")
    assert line.startswith("FAIL") and "ranged" in valid and "bad" not in valid, doc.output
    assert f"bad: policy field 'deny.{n}'" in invalid, doc.output


# -- 7. outcomes the task's author chooses do not trip the host-health breaker -----------------


def test_a_task_timeout_below_one_second_is_refused_naming_the_field(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from fila.core.models import Task
    from tests.support.cli import fila

    make_root(tmp_path)
    (tmp_path / "g.txt").write_text("hello\n")
    assert Task(engine="shell", command="x", targets=["g.txt"], timeout=1000).timeout == 1000
    with pytest.raises(ValidationError):
        Task(engine="shell", command="x", targets=["g.txt"], timeout=999)
    args = ("submit", "--engine", "shell", "--command", "true", "--target", "g.txt", "--timeout")
    assert fila(tmp_path, *args, "1000").exit_code == 0
    res = fila(tmp_path, *args, "1")
    assert res.exit_code == 2 and "timeout" in res.output and "Traceback" not in res.output, res.output


def test_infrastructure_and_engine_failures_still_open_the_breaker(tmp_path: Path) -> None:
    from fila.core.models import ErrorInfo, Record, Status, Task
    from fila.queue import breaker

    root = make_root(tmp_path)
    own = Task(engine="shell", command="false", targets=["x"], timeout=1000)
    authored = [
        Record(id="t", status=Status.failed, task=own, error=ErrorInfo(kind="timeout", message="m")),
        Record(
            id="t",
            status=Status.failed,
            task=own,
            engine="shell",
            exit_code=1,
            error=ErrorInfo(kind="engine_error", message="m"),
        ),
    ]
    for r in authored * 5:
        breaker.record(root, r, worker="w")
    assert not breaker.read(root).open and breaker.read(root).consecutive == 0
    claude = Task(engine="claude", prompt="p", targets=["x"])
    for _ in range(5):  # a real engine's CLI crashing is not its author's choice
        r = Record(
            id="t",
            status=Status.failed,
            task=claude,
            engine="claude",
            exit_code=1,
            error=ErrorInfo(kind="engine_error", message="m"),
        )
        breaker.record(root, r, worker="w")
    assert breaker.read(root).open


@pytest.mark.docker
def test_five_failures_their_author_chose_do_not_stop_the_next_task(
    tmp_path: Path, shell_image: object
) -> None:
    from fila.queue import breaker
    from tests.support.cli import fila
    from tests.support.project import record

    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    base = ("submit", "--engine", "shell", "--target", "greeting.txt")
    for i in range(4):
        assert fila(tmp_path, *base, "--id", f"evil{i}", "--command", "exit 3").exit_code == 0
    slow = "trap 'exit 0' TERM; sleep 30 & wait"
    assert fila(tmp_path, *base, "--id", "evil4", "--timeout", "1000", "--command", slow).exit_code == 0
    victim = ("--id", "victim", "--command", "sed -i s/hello/world/ greeting.txt")
    assert fila(tmp_path, *base, *victim).exit_code == 0
    res = fila(tmp_path, "run", "--once")
    assert "circuit breaker" not in res.output, res.output
    assert [record(tmp_path, f"evil{i}")["error"]["kind"] for i in range(5)] == ["engine_error"] * 4 + [
        "timeout"
    ]
    assert record(tmp_path, "victim")["status"] == "needs_review"
    assert not breaker.read(make_root_at(tmp_path)).open


def make_root_at(path: Path) -> Any:
    from fila.core.layout import Root

    return Root.at(path)


# -- 5. an image or runtime that is not there is that task's record; the run goes on -----------


@pytest.mark.docker
def test_a_pinned_image_or_runtime_that_is_not_there_fails_its_task_and_the_next_runs(
    tmp_path: Path, shell_image: object
) -> None:
    import json

    from tests.support.cli import fila
    from tests.support.project import record

    root = make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    pol = json.loads((root.policies_dir / "default.json").read_text())
    (root.policies_dir / "oddrt.json").write_text(json.dumps({**pol, "runtime": "fila-no-such-runtime"}))
    base = {"engine": "shell", "command": "true", "targets": ["greeting.txt"]}
    tasks = {
        "pinned": {**base, "image": "fila/shell"},  # the allowed counterpart: a pinned image that is here
        "unbuilt": {**base, "image": "fila/doesnotexist"},
        "digest": {**base, "image": "fila/shell@sha256:" + "0" * 64},
        "dotdot": {**base, "image": "fila/../../x"},
        "runtime": {**base, "policy": "oddrt"},
        "victim": {**base, "command": "sed -i s/hello/world/ greeting.txt"},
    }
    for tid, t in tasks.items():
        (root.in_dir / f"{tid}.json").write_text(json.dumps(t))
    res = fila(tmp_path, "run", "--once")
    assert "fila bug" not in res.output and "Traceback" not in res.output, res.output
    assert record(tmp_path, "pinned")["status"] == "needs_review"
    assert record(tmp_path, "victim")["status"] == "needs_review"
    for tid in ("unbuilt", "digest", "dotdot"):
        rec = record(tmp_path, tid)
        assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec
        assert "image" in rec["error"]["message"]
    assert "not a Docker image reference" in record(tmp_path, "dotdot")["error"]["message"]
    rt = record(tmp_path, "runtime")
    assert rt["status"] == "failed" and "fila-no-such-runtime" in rt["error"]["message"], rt
    assert "register" in rt["error"]["message"]
    # At submit the reference is refused with the field named (exit 2), before anything queues.
    sub = fila(
        tmp_path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "--target",
        "greeting.txt",
        "--image",
        "fila/../../x",
    )
    assert sub.exit_code == 2 and "image" in sub.output and "Traceback" not in sub.output, sub.output


# -- the test gap: `fila logs` and `fila diff` escape on a terminal, pass bytes through a pipe ---


def _on_a_terminal(argv: list[str]) -> bytes:
    """What `argv` writes to stdout when stdout is a pseudo-terminal."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        return out
    finally:
        os.close(master)


@pytest.mark.docker
def test_logs_and_diff_escape_engine_control_characters_on_a_terminal_only(
    tmp_path: Path, shell_image: object
) -> None:
    from tests.support.cli import fila
    from tests.support.project import record

    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    cmd = r"printf 'log \033]0;owned\007 \033[2J end\n'; printf 'hi \033[8mhidden\033[0m\n' > greeting.txt"
    res = fila(
        tmp_path, "submit", "--id", "esc", "--engine", "shell", "--command", cmd, "--target", "greeting.txt"
    )
    assert res.exit_code == 0, res.output
    assert fila(tmp_path, "run", "--once").exit_code == 0
    assert record(tmp_path, "esc")["status"] == "needs_review"
    cli = [sys.executable, "-c", "from fila.cli import main; main()"]
    for sub, raw in (("logs", b"\x1b]0;owned\x07"), ("diff", b"\x1b[8mhidden")):
        argv = [*cli, sub, "esc", "--root", str(tmp_path)]
        # Piped, the bytes pass unchanged (`fila diff | git apply` must get the real patch)...
        piped = subprocess.run(argv, capture_output=True, timeout=60, check=True).stdout
        assert raw in piped
        # ...on a terminal no raw ESC or BEL reaches it: they are shown escaped.
        shown = _on_a_terminal(argv)
        assert b"\x1b" not in shown and b"\x07" not in shown, shown
        assert b"\\x1b" in shown, shown


# -- 6. cleanup that cannot finish removes work/ and says so ------------------------------------

_RECLAIM = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from fila.workspace import handover
    from fila.core.errors import FilaError
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    try:
        print("ok", handover.reclaim(Path(sys.argv[1])))
    except FilaError as e:
        print("refused", e)
    """
)


def _engine_left(job: Path, depth: int) -> Path:
    work = job / "work"
    (work / ".git").mkdir(parents=True)
    (work / ".git" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
    (work / "suid").write_text("#!/bin/sh\n")
    os.chmod(work / "suid", 0o4755)
    cur = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    os.chmod(work / "d", 0)
    return work


def test_a_work_dir_fila_cannot_finish_cleaning_is_removed_not_left_live(tmp_path: Path) -> None:
    # The allowed counterpart: 200 levels and a chmod 000 directory are cleaned and kept.
    work = _engine_left(tmp_path / "calm", 200)
    out = subprocess.run(
        [sys.executable, "-c", _RECLAIM, str(work.parent), "1024"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("ok"), out
    assert not (work / ".git").exists() and not os.stat(work / "suid").st_mode & 0o6000
    assert (work / "d" / "d").is_dir()
    # With fewer fds than levels, walking it cannot finish: work/ goes, and the error says so.
    work = _engine_left(tmp_path / "deep", 200)
    out = subprocess.run(
        [sys.executable, "-c", _RECLAIM, str(work.parent), "64"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("refused") and "could not be made safe" in out, out
    assert not work.exists()


# -- 3, the class: only a worker that is stopping hands a task back ----------------------------


def test_a_bug_before_the_container_fails_its_task_once_while_a_stop_hands_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.models import Status
    from fila.queue import store as queue
    from fila.run import job as cycle
    from fila.sandbox.docker.backend import DockerBackend
    from tests.support.cli import fila

    root = make_root(tmp_path)
    (tmp_path / "g.txt").write_text("hello\n")
    for tid in ("stopped", "buggy"):
        res = fila(
            tmp_path, "submit", "--id", tid, "--engine", "shell", "--command", "true", "--target", "g.txt"
        )
        assert res.exit_code == 0, res.output

    def run(tid: str, exc: BaseException) -> None:
        def boom(*_a: object, **_k: object) -> None:
            raise exc

        monkeypatch.setattr(cycle, "check_task", boom)
        claim = queue.try_claim(root, root.queued_path(tid), "w1")
        assert claim is not None
        with pytest.raises(type(exc)):
            cycle.run_one(root, claim, backend=DockerBackend(None))

    # The allowed counterpart: a worker stopping (Ctrl-C) hands the task back, queued as it was.
    run("stopped", KeyboardInterrupt())
    rec = queue.get_record(root, "stopped")
    assert rec.status == Status.queued and root.queued_path("stopped").exists()
    assert rec.attempts[-1].outcome == "handed back"
    # A bug is reported (re-raised) but the task ends failed: claimed again, it would loop.
    run("buggy", ZeroDivisionError("division by zero"))
    rec = queue.get_record(root, "buggy")
    assert rec.status == Status.failed and not root.queued_path("buggy").exists()
    assert rec.error is not None and rec.error.kind == "infra"
    assert rec.error.message == "fila bug: ZeroDivisionError: division by zero"


@pytest.mark.docker
def test_an_engine_image_missing_at_claim_waits_for_its_task_only_and_the_run_goes_on(
    tmp_path: Path, shell_image: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.sandbox.docker.backend import DockerBackend
    from tests.support.cli import fila
    from tests.support.project import record

    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    for tid in ("first", "second"):
        res = fila(
            tmp_path,
            "submit",
            "--id",
            tid,
            "--engine",
            "shell",
            "--command",
            "true",
            "--target",
            "greeting.txt",
        )
        assert res.exit_code == 0, res.output
    real = DockerBackend.image
    missing = {"left": 1}

    def being_built(self: DockerBackend, tag: str) -> Any:
        """The engine's image is not there at the first claim (`fila images build` is making it)."""
        if missing["left"]:
            missing["left"] -= 1
            return None
        return real(self, tag)

    monkeypatch.setattr(DockerBackend, "image", being_built)
    res = fila(tmp_path, "run", "--once")
    assert res.exit_code == 0, res.output
    recs = {tid: record(tmp_path, tid) for tid in ("first", "second")}
    assert all(r["status"] == "needs_review" for r in recs.values()), recs
    waited = [r for r in recs.values() if any(a.get("outcome") == "requeued" for a in r["attempts"])]
    assert len(waited) == 1 and "fila images build shell" in res.output, res.output


@pytest.mark.docker
def test_a_directory_deeper_than_path_max_fails_its_task_and_the_next_runs(
    tmp_path: Path, shell_image: object
) -> None:
    import json

    from tests.support.cli import fila
    from tests.support.project import record

    root = make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    for name, levels in (("near", 15), ("past", 18)):
        (tmp_path / name).mkdir()
        _deep_target(tmp_path / name, levels)
    for tid, target in (("near", "near"), ("past", "past"), ("after", "greeting.txt")):
        task = {"engine": "shell", "command": "true", "targets": [target]}
        (root.in_dir / f"{tid}.json").write_text(json.dumps(task))
    res = fila(tmp_path, "run", "--once")
    assert "fila bug" not in res.output and "Traceback" not in res.output, res.output
    # The allowed counterpart: deep, but every path fits: copied and run.
    assert record(tmp_path, "near")["status"] == "needs_review"
    past = record(tmp_path, "past")
    assert past["status"] == "failed" and past["error"]["kind"] == "invalid" and past["attempt"] == 1, past
    assert record(tmp_path, "after")["status"] == "needs_review"


@pytest.mark.docker
@pytest.mark.skipif(not _has_renameat2(), reason="needs renameat2 (glibc >= 2.28)")
def test_no_run_reads_outside_the_project_while_a_directory_is_swapped_whatever_the_workspace(
    tmp_path: Path, shell_image: object
) -> None:
    """End to end, on fila's default workspace (a copy or an overlay of a snapshot): what the
    engine reads, what its log shows and what fila keeps never hold a file from outside."""
    import json

    from tests.support.cli import fila
    from tests.support.project import record

    root = make_root(tmp_path / "proj")
    outside = tmp_path / "outside"
    outside.mkdir()
    d = root.path / "d"
    (d / "x").mkdir(parents=True)
    for i in range(6):
        (d / "x" / f"f{i}").write_text("decoy\n")
        (outside / f"f{i}").write_text("SECRET\n")
    os.symlink(outside, d / "y")
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    racer = subprocess.Popen(
        [sys.executable, "-c", _RACER, str(d / "x"), str(d / "y"), str(stop), str(ready)]
    )
    try:
        while not ready.exists():
            pass
        for i in range(8):
            task = {"engine": "shell", "command": "cat x/* y/* 2>/dev/null; true", "targets": ["d"]}
            (root.in_dir / f"r{i}.json").write_text(
                json.dumps({**task, "command": "cd d && " + task["command"]})
            )
            fila(root.path, "run", "--once")
    finally:
        stop.touch()
        racer.wait(timeout=30)
    # A run whose copy met the swap mid-walk fails its task; enough of those in a row open the
    # breaker (exit 6) and the later tasks stay unclaimed, with no record: both are fine here.
    statuses = [
        record(root.path, f"r{i}")["status"] if (root.out_dir / f"r{i}.json").exists() else "unclaimed"
        for i in range(8)
    ]
    assert "needs_review" in statuses, statuses  # the allowed counterpart: the project is copied and run
    for dirpath, _dirs, files in os.walk(root.path):
        for name in files:
            p = Path(dirpath, name)
            if not p.is_symlink():
                assert b"SECRET" not in p.read_bytes(), f"{p} holds a file from outside the project"
