"""The cycle with fila run as root and as an ordinary user, on the real Docker daemon.

As root the engine runs as nobody (65534) and work/ is handed over; as an ordinary user the engine
has that user's uid and owns the job directory, so only the mounts keep it from rewriting TASK.md,
input/ or leaving files beside work/. Both modes must behave the same: only work/ changes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fila
from fila.core.layout import Root
from fila.core.models import ImageRef
from fila.workspace import snapshot

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.getuid() != 0, reason="creating an ordinary user for the test needs root"),
]

SOCKET = "/var/run/docker.sock"

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
    ov = snapshot.job_overlay(Root.at(f.root), rec["id"])
    assert ov is not None
    return ov.lower, ov.upper


def _usable_by_anyone(path: Path) -> bool:
    """Can any user run `path` (o+x on it and on every directory above it)?"""
    path = path.resolve()
    return all(os.stat(p).st_mode & 0o001 for p in (path, *path.parents))


def _python_for_others() -> str | None:
    """An interpreter an ordinary user can start, of this one's version (the venv's compiled
    packages must load): the venv's own when it is reachable, else the system's."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for cand in (Path(sys.executable), Path(f"/usr/bin/python{version}")):
        if cand.exists() and _usable_by_anyone(cand):
            return str(cand)
    return None


_RUNTIME: list[str] = []


def _code_for_others() -> str:
    """PYTHONPATH for an ordinary user: fila's source and the venv's packages where anyone can
    read them. The checkout may sit below a directory only root may enter (CI clones into a
    0700 temporary directory): then both are copied, once per test process, to a 0755 one."""
    if _RUNTIME:
        return _RUNTIME[0]
    pkg = Path(fila.__file__).parent
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))

    def readable(p: Path) -> bool:  # o+r on it, o+x on every directory above it
        p = p.resolve()
        return bool(os.stat(p).st_mode & 0o004) and all(os.stat(d).st_mode & 0o001 for d in p.parents)

    if readable(pkg / "__init__.py") and readable(site):
        _RUNTIME.append(f"{pkg.parent}:{site}")
        return _RUNTIME[0]
    base = Path(tempfile.mkdtemp(prefix="fila-runtime-"))
    os.chmod(base, 0o755)
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    shutil.copytree(pkg, base / "src" / "fila", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    # What fila ships beside its code (assets.shipped_dir), and the tests with their configuration
    # (test_podman runs pytest as the user).
    for shipped in ("policies", "images", "tests"):
        shutil.copytree(
            pkg.parents[1] / shipped,
            base / shipped,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copyfile(pkg.parents[1] / "pyproject.toml", base / "pyproject.toml")
    shutil.copytree(site, base / "site", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for d, _dirs, files in os.walk(base):
        os.chmod(d, 0o755)
        for f in files:
            if not os.path.islink(os.path.join(d, f)):
                os.chmod(os.path.join(d, f), 0o644 | (os.stat(os.path.join(d, f)).st_mode & 0o111))
    _RUNTIME.append(f"{base / 'src'}:{base / 'site'}")
    return _RUNTIME[0]


def tests_for_others() -> Path:
    """The tests directory an ordinary user can read: this one, or the copy _code_for_others made."""
    first = Path(_code_for_others().split(":")[0])
    return first.parent / "tests"


# Every write outside work/ must fail inside the container; the one in work/ must land.
ATTEMPTS = (
    'echo "uid=$(id -u)"; echo pwned > ../TASK.md; echo "task=$?"; echo pwned > ../input/greeting.txt; '
    'echo "input=$?"; echo pwned > ../beside.txt; echo "beside=$?"; mkdir ../extra; '
    'echo "mkdir=$?"; sed -i s/hello/world/ greeting.txt && echo "work=$?"'
)


@dataclass
class Fila:
    """`fila` as a separate process, as root or (with `user`) as that ordinary user."""

    root: Path
    user: str | None
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. FILA_WORKSPACE=copy

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid if self.user else 0

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(self.root / ".home"), "FILA_ROOT": str(self.root)}
        env.update(self.extra_env)
        if "DOCKER_HOST" in os.environ:
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        # Both modes run the same fila (the one under test) the same way: an interpreter on the
        # venv's packages and fila's source, all world-readable, while the venv's interpreter may
        # live where only root can go (/root/.pyenv).
        python = sys.executable if self.user is None else _python_for_others()
        if python is None:
            pytest.skip(f"no Python {sys.version_info[:2]} an ordinary user may run")
        if self.user is None:
            site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
            env["PYTHONPATH"] = f"{Path(fila.__file__).parent.parent}:{site}"
        else:
            env["PYTHONPATH"] = _code_for_others()
        argv = [python, "-c", "from fila.cli import main; main()", *args]
        if self.user:
            # runuser sets the user's uid, gid and groups (docker, for the socket) from /etc/group.
            argv = [
                "runuser",
                "-u",
                self.user,
                "--",
                "env",
                "-i",
                *(f"{k}={v}" for k, v in env.items()),
                *argv,
            ]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=self.root)


@contextlib.contextmanager
def ordinary_user() -> Iterator[str]:
    """A throwaway user in the group that owns the Docker socket, removed afterwards."""
    name = f"filat{secrets.token_hex(4)}"
    group = os.stat(SOCKET).st_gid
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/bin/sh", "--user-group", "-G", str(group), name],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(params=["root", "user"])
def run_as(request: pytest.FixtureRequest, shell_image: ImageRef) -> Iterator[Fila]:
    """A queue root (outside pytest's 0700 tmp) owned by whoever runs fila, with a project in it."""
    base = Path(tempfile.mkdtemp(prefix="fila-unpriv-"))
    try:
        with contextlib.ExitStack() as stack:
            user = stack.enter_context(ordinary_user()) if request.param == "user" else None
            f = Fila(base / "q", user)
            f.root.mkdir()
            (f.root / ".home").mkdir()
            (f.root / "greeting.txt").write_text("hello\n")
            if user:
                pw = pwd.getpwnam(user)
                os.chmod(base, 0o755)
                for p in (f.root, f.root / ".home", f.root / "greeting.txt"):
                    os.chown(p, pw.pw_uid, pw.pw_gid)
            res = f("init")
            assert res.returncode == 0, res.stderr
            yield f
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
