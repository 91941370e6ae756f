"""The cycle with fila run as root and as an ordinary user, on the real Docker daemon.

As root the engine runs as nobody (65534) and work/ is handed over; as an ordinary user the engine
has that user's uid and owns the job directory, so only the mounts keep it from rewriting TASK.md,
input/ or leaving files beside work/. Both modes must behave the same: only work/ changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef
from fila.workspace import overlay
from tests.support.users import Fila, fila_on_new_root, ordinary_user

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.getuid() != 0, reason="creating an ordinary user for the test needs root"),
]

# The two workspace strategies: the copy (forced) and the default. The daemon mounts the overlay
# volume, so the default is the overlay whoever runs fila (an ordinary user needs no mount
# privilege); each mode proves its properties on both.
STRATEGIES = [
    pytest.param(({"FILA_WORKSPACE": "copy"}, "copy"), id="copy"),
    pytest.param(({}, "overlay"), id="overlay"),
]


def _layers(f: Fila, rec: dict) -> tuple[Path, Path]:
    """(input/, work/) of a finished job as the host keeps them: the job copy, or the snapshot and
    the upper layer of its overlay (the job directory's input/ and work/ are then mount points)."""
    job = f.root / "sandbox" / "jobs" / rec["id"]
    if rec["workspace"]["strategy"] != "overlay":
        return job / "input", job / "work"
    ov = overlay.job_overlay(Root.at(f.root), rec["id"])
    assert ov is not None
    return ov.lower, ov.upper


# Every write outside work/ must fail inside the container; the one in work/ must land.
ATTEMPTS = (
    'echo "uid=$(id -u)"; echo pwned > ../TASK.md; echo "task=$?"; echo pwned > ../input/greeting.txt; '
    'echo "input=$?"; echo pwned > ../beside.txt; echo "beside=$?"; mkdir ../extra; '
    'echo "mkdir=$?"; sed -i s/hello/world/ greeting.txt && echo "work=$?"'
)


@pytest.fixture(params=["root", "user"])
def run_as(request: pytest.FixtureRequest, shell_image: ImageRef) -> Iterator[Fila]:
    """A queue root (outside pytest's 0700 tmp) owned by whoever runs fila, with a project in it."""
    base = Path(tempfile.mkdtemp(prefix="fila-unpriv-"))
    try:
        with contextlib.ExitStack() as stack:
            user = stack.enter_context(ordinary_user()) if request.param == "user" else None
            yield fila_on_new_root(base, user)
    finally:
        # As root the job's work/ may still belong to nobody after a failure: rmtree as root is fine.
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("workspace", STRATEGIES)
def test_only_work_is_writable_to_the_engine_whoever_runs_fila(
    run_as: Fila, workspace: tuple[dict[str, str], str]
) -> None:
    f = run_as
    f.extra_env, strategy = workspace
    res = f("submit", "--engine", "shell", "--command", ATTEMPTS, "--target", "greeting.txt")
    assert res.returncode == 0, res.stderr
    tid = res.stdout.strip()
    res = f("run", "--once")
    assert res.returncode == 0, res.stdout + res.stderr
    job = f.root / "sandbox" / "jobs" / tid
    rec = json.loads((f.root / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["workspace"]["strategy"] == strategy, rec["workspace"]
    input_dir, work = _layers(f, rec)
    task_md = (job / "TASK.md").read_text()
    log = (f.root / "fila" / "logs" / f"{tid}.log").read_text()

    # The engine ran with the uid of the mode: nobody under root, the user's own otherwise.
    assert f"uid={65534 if f.user is None else f.uid}\n" in log
    # The allowed counterpart first: the write in work/ landed...
    assert "work=0" in log and (work / "greeting.txt").read_text() == "world\n"
    # ...and every other write failed inside the container, said so, and left nothing.
    for attempt in ("task", "input", "beside", "mkdir"):
        assert f"{attempt}=0" not in log and f"{attempt}=" in log, attempt
    assert log.count("Read-only file system") + log.count("Permission denied") >= 4, log
    if f.user is not None:
        # The engine owns the job directory here: only the read-only mount stops it.
        assert (job / "TASK.md").stat().st_uid == f.uid
        assert log.count("Read-only file system") >= 4, log
    assert task_md.startswith("# Task") and not task_md.startswith("pwned")
    assert (input_dir / "greeting.txt").read_text() == "hello\n"
    assert sorted(e.name for e in job.iterdir()) == ["DIFF.patch", "TASK.md", "input", "work"]
    if strategy == "overlay":  # the engine's writes are in the upper layer, and only the one it made
        assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == ["greeting.txt"]

    show = f("show", tid, "--json")
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["status"] == "needs_review"
    diff = f("diff", tid)
    assert diff.returncode == 0, diff.stderr
    assert [ln for ln in diff.stdout.splitlines() if ln.startswith("diff --git")] == [
        "diff --git a/greeting.txt b/greeting.txt"
    ]
    assert "-hello\n+world\n" in diff.stdout

    res = f("apply", tid, "--yes")
    assert res.returncode == 0, res.stderr
    landed = f.root / "greeting.txt"
    assert landed.read_text() == "world\n"
    assert landed.stat().st_uid == f.uid  # the project stays its owner's


@pytest.mark.parametrize("workspace", STRATEGIES)
def test_a_directory_target_round_trips_the_same_whoever_runs_fila(
    run_as: Fila, workspace: tuple[dict[str, str], str]
) -> None:
    f = run_as
    f.extra_env, strategy = workspace
    src = f.root / "src"
    src.mkdir()
    (src / "a.txt").write_text("one\n")
    (src / "old.txt").write_text("gone soon\n")
    if f.user:
        pw = pwd.getpwnam(f.user)
        for p in (src, src / "a.txt", src / "old.txt"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    cmd = (
        "echo two >> src/a.txt && rm src/old.txt && printf '#!/bin/sh\\n' > src/run.sh && "
        "chmod 4755 src/run.sh && mkdir src/sub && echo deep > src/sub/d.txt && ln -s a.txt src/link"
    )
    res = f("submit", "--engine", "shell", "--command", cmd, "--target", "src")
    assert res.returncode == 0, res.stderr
    tid = res.stdout.strip()
    res = f("run", "--once")
    assert res.returncode == 0, res.stdout + res.stderr
    rec = json.loads((f.root / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "needs_review"
    assert rec["workspace"]["strategy"] == strategy, rec["workspace"]
    assert sorted(rec["diffstat"]["paths"]) == [
        "src/a.txt",
        "src/link",
        "src/old.txt",
        "src/run.sh",
        "src/sub/d.txt",
    ]
    # The engine's setuid bit is stripped on the way back, and said so, in both modes.
    assert any("setuid" in w for w in rec["warnings"]), rec["warnings"]
    _, work = _layers(f, rec)
    entries = list(work.rglob("*"))
    whiteouts = [p for p in entries if stat.S_ISCHR(p.lstat().st_mode) and p.lstat().st_rdev == 0]
    # work/ is the host user's again. A deletion in an overlay's upper layer is a whiteout (a 0/0
    # device, no file) that the kernel makes with the mounting daemon's root credentials: fila run
    # by an ordinary user cannot chown it, but that user's gc removes it with the rest (below).
    assert {p.lstat().st_uid for p in entries if p not in whiteouts} == {f.uid}
    assert [p.relative_to(work).as_posix() for p in whiteouts] == (
        ["src/old.txt"] if strategy == "overlay" else []
    )

    res = f("apply", tid, "--yes")
    assert res.returncode == 0, res.stderr
    assert (src / "a.txt").read_text() == "one\ntwo\n" and not (src / "old.txt").exists()
    assert (src / "run.sh").stat().st_mode & 0o7777 == 0o755
    assert os.readlink(src / "link") == "a.txt" and (src / "sub" / "d.txt").read_text() == "deep\n"
    assert {p.lstat().st_uid for p in src.rglob("*")} == {f.uid}
    # Whoever ran fila removes all the job left, the engine's work/ included, once decided.
    res = f("gc", "--older-than", "0s")
    assert res.returncode == 0, res.stderr
    assert not work.exists() and not (f.root / "sandbox" / "jobs" / tid).exists()
