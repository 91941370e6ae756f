"""Hostile input at fila's intake: whatever lands in fila/in/ (any
bytes, any JSON, a FIFO, a socket, a device, a directory, a symlink to anything, a name with
control characters), whatever `fila submit` reads, whatever a policy file holds, ends as a record
`failed`/`invalid` or a file in fila/rejected/ with a reason, never a hang, a traceback, a claim
left behind or a poison pill; and a task Docker refuses is that task's record, not the end of
the run. Every refusal is shown beside the allowed counterpart succeeding in the same test."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from bench.fuzz import (
    base_policy,
    dumps,
    hostile_text,
    policy_bytes,
    raw_tricks,
    task_bytes,
    task_docs,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fila.core import untrusted
from fila.core.errors import InvalidInput, InvalidPolicy, InvalidTaskFile
from fila.core.layout import Root
from fila.core.models import ImageRef, Status, Task
from fila.core.states import valid_id
from fila.queue import store as queue
from fila.queue.policy import load_policy
from fila.run.intake import check_task, parse_task_bytes, parse_task_file
from tests.support.cli import CLI, submit_process
from tests.support.cli import fila as fila_in_process
from tests.support.cli import fila_process as fila
from tests.support.project import make_project, make_root
from tests.support.spy import finishes, watch

S = Status
GOOD = {"engine": "shell", "command": "echo changed > greeting.txt", "targets": ["greeting.txt"]}
HYP = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)


@pytest.fixture(scope="module")
def qroot(tmp_path_factory: pytest.TempPathFactory) -> Root:
    return make_project(tmp_path_factory.mktemp("hostile"))


# -- the poison set: every kind of entry, made in a directory ---------------------------------


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays


def _big_sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB of nothing: read whole, it would fill memory


def make_entry(kind: str, path: Path, aside: Path) -> None:
    """One poison entry at `path`; symlink targets go into `aside`."""
    aside.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        _socket(path)
    elif kind == "device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: needs root
    elif kind == "directory":
        path.mkdir()
        (path / "inner.json").write_text(json.dumps(GOOD))
    elif kind == "huge file":
        _big_sparse(path)
    elif kind == "symlink to a FIFO":
        fifo = aside / f"{path.name}.fifo"
        os.mkfifo(fifo)
        path.symlink_to(fifo)
    elif kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink to a huge file":
        _big_sparse(aside / f"{path.name}.big")
        path.symlink_to(aside / f"{path.name}.big")
    elif kind == "dangling symlink":
        path.symlink_to(aside / "nothing-here")
    elif kind == "symlink to a directory":
        path.symlink_to(aside)
    elif kind == "symlink to a valid task":
        (aside / f"{path.name}.real").write_text(json.dumps(GOOD))
        path.symlink_to(aside / f"{path.name}.real")
    else:
        raise AssertionError(kind)


ENTRY_KINDS = [
    "fifo",
    "socket",
    "device",
    "directory",
    "huge file",
    "symlink to a FIFO",
    "symlink to /dev/zero",
    "symlink to a huge file",
    "dangling symlink",
    "symlink to a directory",
    "symlink to a valid task",
]
# What the refusal names, per kind: the entry itself is judged, never what a link points to.
NAMED = {
    "fifo": "a FIFO",
    "socket": "a socket",
    "device": "a character device",
    "directory": "a directory",
    "huge file": "above the 1048576-byte limit",
}
BAD_CONTENTS = {
    "nan": b'{"engine":"shell","command":"true","targets":["greeting.txt"],"timeout":NaN}',
    "inf": b'{"engine":"shell","command":"true","targets":["greeting.txt"],"timeout":1e400}',
    "huge-int": b'{"engine":"shell","command":"true","targets":["greeting.txt"],"timeout":'
    + b"9" * 5000
    + b"}",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "nul": b'{"engine":"shell","command":"true","targets":["greeting\\u0000.txt"]}',
    "bidi": b'{"engine":"shell","command":"true","targets":["greeting\\u202e.txt"]}',
    "escape": b'{"engine":"shell","command":"true","targets":["\\u001b[2Jgreeting.txt"]}',
    "surrogate": b'{"engine":"shell","command":"true","targets":["\\ud800"]}',
    "dup-key": b'{"engine":"shell","engine":"nope","command":"true","targets":["greeting.txt"]}',
    "binary": bytes(range(256)),
    "not-utf8": b'{"engine":"shell","targets":["\xff"]}',
}
BAD_NAMES = [
    "bad name.json",
    "nl.json\n",
    "ctl\x1b[31m.json",
    "bidi\u202e.json",
    "x.txt",
    "tab\t.json",
    "\u00fc.json",
]
# Hidden entries are fila's temp files (and .gitkeep): never claimed, never opened; recovery
# removes only regular `.*.tmp` files, so a hidden FIFO or directory stays inert.
HIDDEN = {".x.json": "fifo", ".y.json.1.tmp": "directory", ".z.json.2.tmp": "fifo"}


def _kind_id(kind: str) -> str:
    return "k-" + untrusted.safe_name(kind).replace("_", "-")


def drop_poison(root: Root, aside: Path) -> dict[str, str]:
    """Every poison entry with a valid id -> what its record's message must say; plus entries
    whose names are no id (they end in fila/rejected/)."""
    expect: dict[str, str] = {}
    for kind in ENTRY_KINDS:
        tid = _kind_id(kind)
        make_entry(kind, root.in_dir / f"{tid}.json", aside)
        expect[tid] = NAMED.get(kind, "a symlink")
    for name, raw in BAD_CONTENTS.items():
        (root.in_dir / f"c-{name}.json").write_bytes(raw)
        expect[f"c-{name}"] = ""
    for name in BAD_NAMES:
        (root.in_dir / name).write_text(json.dumps(GOOD))
    for name, kind in HIDDEN.items():
        make_entry(kind, root.in_dir / name, aside)
        os.utime(root.in_dir / name, (1, 1))  # old enough for any temp-file sweep
    return expect


def in_entries(root: Root) -> list[str]:
    return sorted(n for n in os.listdir(root.in_dir) if not n.startswith("."))


def assert_settled(root: Root, expect: dict[str, str]) -> None:
    """Every poison entry is a failed/invalid record whose message names it, or a rejected
    file with a reason; nothing is left in in/ or run/."""
    assert in_entries(root) == []
    assert os.listdir(root.run_dir) == []
    assert all(os.path.lexists(root.in_dir / n) for n in HIDDEN), "hidden entries are left alone"
    for tid, words in expect.items():
        rec = queue.read_record(root, tid)
        assert rec is not None, f"{tid}: no record"
        assert rec.status == S.failed and rec.error is not None and rec.error.kind == "invalid", rec
        assert words in rec.error.message, (tid, rec.error.message)
        assert (root.rejected_dir / f"{tid}.json.reason").is_file()
        kept = root.rejected_dir / f"{tid}.json"
        if tid in (_kind_id("fifo"), _kind_id("socket"), _kind_id("device")):
            assert not os.path.lexists(kept), "a FIFO, socket or device is removed, never kept"
        else:
            assert os.path.lexists(kept), f"{tid}: the file is kept"
    strays = sorted(p.name for p in root.rejected_dir.iterdir() if p.name.startswith("stray."))
    assert len([n for n in strays if n.endswith(".reason")]) == len(BAD_NAMES), strays
    for n in strays:
        assert valid_id(n), f"rejected/ names are safe: {n!r}"
    reasons = "".join((root.rejected_dir / n).read_text() for n in strays if n.endswith(".reason"))
    assert "'nl.json\\n'" in reasons and "'ctl\\x1b[31m.json'" in reasons  # named, escaped


def no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert "fila bug" not in res.stderr, res.stderr


# -- the reader ------------------------------------------------------------------------------


def test_an_id_with_a_trailing_newline_is_not_an_id() -> None:
    assert valid_id("task-1") and valid_id("a.b_c-9")
    for bad in ("task-1\n", "task-1\r", "\ntask-1", "a b", ".", "..", "", "x" * 129):
        assert not valid_id(bad), repr(bad)


@pytest.mark.parametrize("kind", ENTRY_KINDS)
def test_the_reader_refuses_every_non_regular_entry_without_opening_it(kind: str, tmp_path: Path) -> None:
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(GOOD))
    with watch() as seen:
        assert parse_task_file(ok).engine == "shell"  # the allowed counterpart, read
    assert seen.read(ok)
    path = tmp_path / "t.json"
    make_entry(kind, path, tmp_path / "aside")
    with watch() as seen, pytest.raises(InvalidTaskFile) as e:
        finishes(lambda: parse_task_file(path))  # nothing blocks
    assert not [r for r in seen.reads if r.startswith(os.path.realpath(tmp_path))], seen.reads
    assert NAMED.get(kind, "a symlink") in str(e.value)


def test_a_file_swapped_for_a_fifo_after_the_check_is_still_not_read(tmp_path: Path) -> None:
    """The descriptor is checked again after the open (lstat, then open, then fstat): open
    with O_NOFOLLOW|O_NONBLOCK never blocks, and the fstat sees the swap."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD))
    st0 = os.lstat(path)
    real_lstat = os.lstat

    def swapping_lstat(p: object, *a: object, **kw: object) -> os.stat_result:
        res = real_lstat(p, *a, **kw)  # type: ignore[arg-type]
        if Path(str(p)) == path and path.is_file():
            path.unlink()
            os.mkfifo(path)
        return res

    assert st0.st_size > 0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(untrusted.os, "lstat", swapping_lstat)
        with pytest.raises(InvalidTaskFile, match="replaced while it was opened"):
            untrusted.read_capped(path, cap=1 << 20, kind="task", error=InvalidTaskFile)


@pytest.mark.parametrize("name", sorted(BAD_CONTENTS))
def test_hostile_json_is_refused_with_the_problem_named(name: str, tmp_path: Path) -> None:
    ok = tmp_path / "ok.json"
    ok.write_bytes(dumps(GOOD))
    assert parse_task_file(ok).targets == ["greeting.txt"]
    path = tmp_path / "t.json"
    path.write_bytes(BAD_CONTENTS[name])
    with pytest.raises(InvalidTaskFile) as e:
        parse_task_file(path)
    words = {
        "nan": "NaN",
        "inf": "out of range",
        "huge-int": "30-digit limit",
        "deep": "nesting deeper than 32",
        "nul": "NUL",
        "bidi": "bidi",
        "escape": "control character U+001B",
        "surrogate": "surrogate",
        "dup-key": "appears twice",
        "binary": "not UTF-8",
        "not-utf8": "not UTF-8",
    }[name]
    assert words in str(e.value)


@HYP
@given(raw=task_bytes)
def test_any_task_bytes_end_as_a_task_or_an_input_error(qroot: Root, raw: bytes) -> None:
    """The loaders a worker runs on a dropped file, and `fila submit -`: a value or InvalidInput."""
    path = qroot.in_dir / "h.json"
    path.write_bytes(raw)
    for load in (
        lambda: parse_task_file(path, expected_id="h"),
        lambda: parse_task_bytes(raw, source="stdin"),
    ):
        with suppress(InvalidInput):
            check_task(qroot, load())
    path.unlink()


def assert_input_error(e: InvalidInput) -> None:
    """What an input error means here: the CLI's exit code for bad input (2), and a message with
    words in it (not empty nor blank). Its text may hold what the input held (a key with a control
    character): the CLI escapes it where it prints it (test_terminal_text)."""
    assert e.exit_code == 2
    assert e.message.strip(), repr(e.message)


@HYP
@given(doc=task_docs)
def test_task_shaped_documents_with_a_hostile_field_end_as_a_task_or_an_input_error(
    qroot: Root, doc: dict[str, object]
) -> None:
    raw = dumps(doc)
    try:
        task = parse_task_bytes(raw, source="stdin")
        check_task(qroot, task)
    except InvalidInput as e:
        assert_input_error(e)
        return
    # Accepted: every name it carries is clean, and it serialises back (a record can hold it).
    assert Task.model_validate_json(task.model_dump_json()) == task
    for t in task.targets:
        assert untrusted.name_problem(t) is None


def test_a_valid_task_document_is_accepted(qroot: Root) -> None:
    """The counterpart of the two properties above: they are not vacuous."""
    check_task(qroot, parse_task_bytes(dumps(GOOD), source="stdin"))


@HYP
@given(raw=policy_bytes)
def test_any_policy_bytes_end_as_a_policy_or_invalid_policy(qroot: Root, raw: bytes) -> None:
    (qroot.policies_dir / "hyp.json").write_bytes(raw)
    try:
        policy, ref = load_policy(qroot, "hyp")
    except InvalidPolicy as e:
        assert_input_error(e)
        return
    assert policy.max_timeout_ms >= policy.default_timeout_ms and len(ref.sha256) == 64


@pytest.mark.parametrize("kind", [*ENTRY_KINDS, "nan", "deep", "bidi-deny"])
def test_a_hostile_policy_file_is_refused_and_submit_with_it_exits_2(kind: str, tmp_path: Path) -> None:
    root = make_root(tmp_path / "q")
    (root.path / "greeting.txt").write_text("hello\n")
    good = base_policy()
    (root.policies_dir / "fine.json").write_text(json.dumps(good))
    res = fila_in_process(
        root.path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "-t",
        "greeting.txt",
        "--policy",
        "fine",
    )
    assert res.exit_code == 0, res.output  # the allowed counterpart
    path = root.policies_dir / "bad.json"
    if kind == "nan":
        path.write_bytes(json.dumps({**good, "cpus": float("nan")}).encode())
    elif kind == "deep":
        path.write_bytes(b"[" * 50_000 + b"]" * 50_000)
    elif kind == "bidi-deny":
        path.write_text(json.dumps({**good, "deny": ["secret\u202e.txt"]}))
    else:
        make_entry(kind, path, tmp_path / "aside")
    res = subprocess.run(
        [
            *CLI,
            "submit",
            "--engine",
            "shell",
            "--command",
            "true",
            "-t",
            "greeting.txt",
            "--policy",
            "bad",
            "--root",
            str(root.path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    no_traceback(res)
    assert "bad.json" in res.stderr


@pytest.mark.parametrize("kind", [*ENTRY_KINDS, *sorted(BAD_CONTENTS)])
def test_submit_of_a_hostile_file_exits_2_with_a_message(kind: str, tmp_path: Path, qroot: Root) -> None:
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(GOOD))
    res = subprocess.run(
        [*CLI, "submit", str(ok), "--root", str(qroot.path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr  # the allowed counterpart
    path = tmp_path / "t.json"
    if kind in BAD_CONTENTS:
        path.write_bytes(BAD_CONTENTS[kind])
    else:
        make_entry(kind, path, tmp_path / "aside")
    res = subprocess.run(
        [*CLI, "submit", str(path), "--root", str(qroot.path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stdout + res.stderr
    no_traceback(res)
    assert "error:" in res.stderr


@settings(HYP, max_examples=40)
@given(raw=st.one_of(task_bytes, raw_tricks, st.binary(min_size=1 << 20, max_size=(1 << 20) + 10)))
def test_submit_from_stdin_exits_0_or_2_never_a_traceback(qroot: Root, raw: bytes) -> None:
    res = fila_in_process(qroot.path, "submit", "-", input=raw)  # type: ignore[arg-type]
    assert res.exit_code in (0, 2, 4), res.output  # 4: a generated id that exists already
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


def test_submit_from_stdin_refuses_more_than_the_cap(qroot: Root) -> None:
    ok = dumps(GOOD)
    assert fila_in_process(qroot.path, "submit", "-", input=ok).exit_code == 0  # type: ignore[arg-type]
    big = dumps({**GOOD, "prompt": "x" * (1 << 20)})
    res = fila_in_process(qroot.path, "submit", "-", input=big)  # type: ignore[arg-type]
    assert res.exit_code == 2 and "1048576-byte limit" in res.output


def test_submit_from_options_refuses_what_a_claim_would_refuse(qroot: Root) -> None:
    args = ["submit", "--engine", "shell", "--command", "true", "--target", "greeting.txt"]
    assert fila_in_process(qroot.path, *args, "--prompt", "plain words").exit_code == 0
    queued = set(os.listdir(qroot.in_dir))
    res = fila_in_process(qroot.path, *args, "--prompt", "a\x00b")
    assert res.exit_code == 2 and "NUL" in res.output, res.output
    assert set(os.listdir(qroot.in_dir)) == queued  # nothing queued to be refused at claim


# -- the queue, with real containers ---------------------------------------------------------


@pytest.fixture
def proj(tmp_path: Path, shell_image: ImageRef) -> Root:
    return make_project(tmp_path / "q")


def submit_good(root: Root, tid: str) -> None:
    submit_process(root, tid, GOOD["command"], check=True)


@pytest.mark.docker
def test_run_once_settles_every_poison_entry_and_still_runs_the_valid_task(
    proj: Root, tmp_path: Path
) -> None:
    submit_good(proj, "good-before")
    expect = drop_poison(proj, tmp_path / "aside")
    submit_good(proj, "good-after")
    res = fila(proj, "run", "--once", timeout=180)  # a hang fails the test
    no_traceback(res)
    assert res.returncode == 2, res.stdout + res.stderr  # invalid tasks, and no other failure
    for tid in ("good-before", "good-after"):
        rec = queue.read_record(proj, tid)
        assert rec is not None and rec.status == S.needs_review, rec
    assert_settled(proj, expect)
    rec = fila(proj, "recover", "--json", check=True)
    no_traceback(rec)
    assert in_entries(proj) == [] and os.listdir(proj.run_dir) == []  # nothing put back
    again = fila(proj, "run", "--once", timeout=120)
    no_traceback(again)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_settled(proj, expect)


@pytest.mark.docker
@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "directory"])
def test_a_worker_killed_after_claiming_a_poison_entry_leaves_nothing_recover_puts_back_to_crash(
    proj: Root, tmp_path: Path, kind: str
) -> None:
    make_entry(kind, proj.in_dir / "p.json", tmp_path / "aside")
    res = fila(proj, "run", "--once", crash="after_claim", timeout=60)
    assert res.returncode == -signal.SIGKILL
    assert [n.split("~")[0] for n in os.listdir(proj.run_dir)] == ["p"]  # the claim was left
    submit_good(proj, "good")
    no_traceback(fila(proj, "recover", check=True))
    res = fila(proj, "run", "--once", timeout=120)
    no_traceback(res)
    assert res.returncode == 2, res.stdout + res.stderr
    assert queue.read_record(proj, "good").status == S.needs_review  # type: ignore[union-attr]
    rec = queue.read_record(proj, "p")
    assert rec is not None and rec.status == S.failed and rec.error and rec.error.kind == "invalid"
    assert in_entries(proj) == [] and os.listdir(proj.run_dir) == []
    no_traceback(fila(proj, "recover", check=True))
    assert fila(proj, "run", "--once", timeout=60).returncode == 0


entry_strategy = st.tuples(
    st.sampled_from(["content", *ENTRY_KINDS[:4], "dangling symlink", "symlink to /dev/zero"]),
    st.one_of(task_bytes, st.sampled_from(sorted(BAD_CONTENTS.values()))),
    st.one_of(
        st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True), hostile_text.filter(lambda s: 0 < len(s) < 60)
    ),
)


# Each draw is a `fila run --once`, a recovery and one more run (about 2 s): the default run
# draws three, `scripts/test --all` eight more of its own (the `matrix` twin below).
@pytest.mark.docker
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(entries=st.lists(entry_strategy, min_size=1, max_size=5))
# Found by a random draw (seed 10): a queued task nested past the recursion limit crashed the
# spare-gateway thread's peek at the queue.
@example(entries=[("content", b"[" * 992 + b"]" * 992, "0")])
def test_generated_queue_entries_all_end_as_records_or_rejected_files(
    shell_image: ImageRef, tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[str, bytes, str]]
) -> None:
    _generated_entries_end_settled(tmp_path_factory, entries)


@pytest.mark.docker
@pytest.mark.matrix  # more draws of the case above (about 15 s): scripts/test --all
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(entries=st.lists(entry_strategy, min_size=1, max_size=5))
def test_more_generated_queue_entries_all_end_as_records_or_rejected_files(
    shell_image: ImageRef, tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[str, bytes, str]]
) -> None:
    _generated_entries_end_settled(tmp_path_factory, entries)


def _generated_entries_end_settled(
    tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[str, bytes, str]]
) -> None:
    """The entries dropped in in/, one `fila run --once`: each ends as a record or a rejected file,
    nothing is left claimed, and a recovery and a second run find nothing to do."""
    base = tmp_path_factory.mktemp("gen")
    root = make_root(base / "q")
    made = set()
    for kind, raw, stem in entries:
        name = f"{stem}.json"
        if "/" in name or "\x00" in name or name.startswith(".") or name in made:
            continue
        try:
            path = root.in_dir / name
            path.parent.resolve()
            if kind == "content":
                path.write_bytes(raw)
            else:
                make_entry(kind, path, base / "aside")
        except (OSError, UnicodeEncodeError, ValueError):
            continue  # a name the file system refuses
        made.add(name)
    res = fila(root, "run", "--once", timeout=120)
    no_traceback(res)
    assert res.returncode in (0, 1, 2), res.stdout + res.stderr
    assert in_entries(root) == [] and os.listdir(root.run_dir) == []
    for name in made:
        stem = name[: -len(".json")]
        if name.endswith(".json") and valid_id(stem):
            rec = queue.read_record(root, stem)
            assert rec is not None and rec.status in (S.failed, S.needs_review, S.needs_human), (name, rec)
            if rec.status == S.failed:
                assert rec.error is not None and rec.error.message
    for p in root.rejected_dir.iterdir():
        assert valid_id(p.name), f"unsafe name in rejected/: {p.name!r}"
    no_traceback(fila(root, "recover", check=True))
    again = fila(root, "run", "--once", timeout=60)
    no_traceback(again)
    assert again.returncode == 0 and in_entries(root) == []


@contextmanager
def worker(root: Root, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [*CLI, "worker"], env={**os.environ, "FILA_ROOT": str(root.path)}, stdout=out, stderr=out
        )
        try:
            yield p
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():  # type: ignore[operator]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _status(root: Root, tid: str) -> Status | None:
    rec = queue.read_record(root, tid)
    return rec.status if rec else None


@pytest.mark.docker
def test_a_worker_settles_the_same_poison_runs_the_valid_task_and_stops_promptly_on_sigterm(
    proj: Root, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with worker(proj, log) as w:
        submit_good(proj, "good-1")
        wait_for(lambda: _status(proj, "good-1") == S.needs_review, 60, "the valid task before the poison")
        expect = drop_poison(proj, tmp_path / "aside")
        submit_good(proj, "good-2")
        wait_for(
            lambda: _status(proj, "good-2") == S.needs_review and all(_status(proj, t) for t in expect),
            90,
            "the poison entries and the valid task",
        )
        wait_for(lambda: in_entries(proj) == [], 30, "in/ to be empty")
        assert w.poll() is None, "the worker keeps running"
        assert_settled(proj, expect)
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=15) == 0  # promptly: an idle worker has nothing to finish
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "fila bug" not in text, text
    assert "is not a task file name: rejected" in text


# -- point 2: a task Docker refuses is that task's record -------------------------------------


def docker_refused_tasks(root: Root) -> dict[str, str]:
    """Tasks that pass fila's checks and that Docker refuses (HTTP 400): tid -> Docker's words.
    (An unregistered runtime is refused by fila itself before Docker sees it, as an infra error.)"""
    pol = base_policy()
    (root.policies_dir / "wide.json").write_text(json.dumps({**pol, "cpus": 64.0}))
    base = ["--engine", "shell", "--command", "true", "--target", "greeting.txt"]
    fila(root, "submit", "--id", "cpus", *base, "--policy", "wide", check=True)  # the policy's 64 CPUs
    # the task's own limit, within its policy, above what this host has
    task = {"id": "limits", **GOOD, "command": "true", "policy": "wide", "limits": {"cpus": 32}}
    (root.path / "limits.json").write_text(json.dumps(task))
    fila(root, "submit", str(root.path / "limits.json"), check=True)
    # an image reference Docker cannot parse that the policy's glob allows: fila checks Docker's
    # reference grammar itself, so it is refused at submit, never sent
    task = {
        "id": "badref",
        "engine": "shell",
        "command": "true",
        "targets": ["greeting.txt"],
        "image": "fila/Shell:latest",
    }
    (root.path / "badref.json").write_text(json.dumps(task))
    res = fila(root, "submit", str(root.path / "badref.json"))
    assert res.returncode == 2 and "not a Docker image reference" in res.stderr, res.stderr
    return {"cpus": "Range of CPUs", "limits": "Range of CPUs"}


def assert_refused(root: Root, refused: dict[str, str]) -> None:
    for tid, words in refused.items():
        rec = queue.read_record(root, tid)
        assert rec is not None and rec.status == S.failed, rec
        assert rec.error is not None and rec.error.kind == "invalid", rec.error
        assert "docker refused this task" in rec.error.message and words in rec.error.message, rec.error
        assert not rec.container_started


@pytest.mark.docker
def test_run_once_records_each_task_docker_refuses_and_runs_the_rest(proj: Root) -> None:
    refused = docker_refused_tasks(proj)
    submit_good(proj, "good")
    res = fila(proj, "run", "--once", timeout=180)
    no_traceback(res)
    assert res.returncode == 2, res.stdout + res.stderr  # not 3: Docker is healthy
    assert _status(proj, "good") == S.needs_review
    assert_refused(proj, refused)
    assert in_entries(proj) == [] and os.listdir(proj.run_dir) == []


@pytest.mark.docker
def test_a_worker_records_each_task_docker_refuses_and_runs_the_rest(proj: Root, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with worker(proj, log) as w:
        refused = docker_refused_tasks(proj)
        submit_good(proj, "good")
        wait_for(
            lambda: (
                _status(proj, "good") == S.needs_review and all(_status(proj, t) == S.failed for t in refused)
            ),
            90,
            "the refused tasks and the valid one",
        )
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=15) == 0
    assert_refused(proj, refused)
    assert "Traceback" not in log.read_text(errors="replace")


# -- the fuzz harness (bench/fuzz.py) ---------------------------------------------------------


def test_the_fuzz_harness_counts_outcomes_and_reports_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.fuzz as fz

    found = fz.fuzz(3, batch=20)
    assert set(found.inputs) == set(fz.TARGETS) and all(n >= 20 for n in found.inputs.values())
    assert not found.crashes, fz.report(found, 3)  # the real loaders: no crash
    assert "InvalidTaskFile" in found.outcomes["task file (fila/in)"]

    def broken(_root: object, raw: bytes) -> str:  # a loader with a bug on some inputs
        if len(raw) % 2:
            raise KeyError("bug")
        return "accepted"

    monkeypatch.setattr(fz, "TARGETS", {"broken": (broken, fz.task_bytes)})
    found = fz.fuzz(1, batch=20)
    assert "broken: CRASH KeyError" in found.crashes
    text = fz.report(found, 1)
    assert "crashes (distinct target/type): 1" in text and "KeyError: 'bug'" in text
