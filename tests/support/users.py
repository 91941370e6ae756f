"""fila, pytest or a script run as a throwaway ordinary user: in the Docker group (the Docker
socket's), or with subordinate ids and no docker group (rootless Podman)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fila

SOCKET = "/var/run/docker.sock"
# The PATH of a user's clean environment (env -i): nothing of root's.
USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def python_for_others() -> str | None:
    """An interpreter an ordinary user can start, of this one's version (the venv's compiled
    packages must load): the venv's own when it is reachable, else the system's."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for cand in (Path(sys.executable), Path(f"/usr/bin/python{version}")):
        path = cand.resolve()
        if path.exists() and all(os.stat(p).st_mode & 0o001 for p in (path, *path.parents)):
            return str(cand)
    return None


_RUNTIME: list[str] = []


def code_for_others() -> str:
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
    # (pytest_as_user runs pytest as the user).
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


def readable_tests_dir() -> Path:
    """The tests directory an ordinary user can read: this one, or the copy code_for_others made."""
    first = Path(code_for_others().split(":")[0])
    return first.parent / "tests"


def as_user(user: str, env: dict[str, str]) -> list[str]:
    """The argv prefix that runs a command as `user` with `env` and nothing else of root's
    (runuser sets the user's uid, gid and groups from /etc/group)."""
    return ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items())]


def podman_env(user: str, **extra: str) -> dict[str, str]:
    """A rootless Podman user's clean environment, with fila's code readable (code_for_others)."""
    return {"PATH": USER_PATH, "HOME": pwd.getpwnam(user).pw_dir, "PYTHONPATH": code_for_others(),
            "PYTHONDONTWRITEBYTECODE": "1", **extra}  # fmt: skip


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
        python = sys.executable if self.user is None else python_for_others()
        if python is None:
            pytest.skip(f"no Python {sys.version_info[:2]} an ordinary user may run")
        if self.user is None:
            site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
            env["PYTHONPATH"] = f"{Path(fila.__file__).parent.parent}:{site}"
        else:
            env["PYTHONPATH"] = code_for_others()
        argv = [python, "-c", "from fila.cli import main; main()", *args]
        if self.user:
            argv = [*as_user(self.user, env), *argv]
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


def fila_on_new_root(base: Path, user: str | None, extra_env: dict[str, str] | None = None) -> Fila:
    """fila as root or as `user` on a new queue root `base`/q that user owns, with greeting.txt in
    it; `base` lies outside pytest's 0700 tmp (an ordinary user must reach it)."""
    f = Fila(base / "q", user, extra_env or {})
    (f.root / ".home").mkdir(parents=True)
    (f.root / "greeting.txt").write_text("hello\n")
    if user:
        pw = pwd.getpwnam(user)
        os.chmod(base, 0o755)
        for p in (f.root, f.root / ".home", f.root / "greeting.txt"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    res = f("init")
    assert res.returncode == 0, res.stderr
    return f


@contextlib.contextmanager
def podman_user() -> Iterator[str]:
    """A throwaway user with subordinate ids (useradd gives them) and no docker group."""
    name = f"filapm{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--user-group", name],
                   check=True, capture_output=True)  # fmt: skip
    pw = pwd.getpwnam(name)
    try:
        yield name
    finally:
        # Only the processes of the user made here: its Podman service, conmon, containers.
        for _ in range(50):  # userdel refuses a user with a process left: kill -9 is not instant
            pids = subprocess.run(
                ["pgrep", "-u", str(pw.pw_uid)], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            if subprocess.run(["userdel", name], capture_output=True).returncode in (0, 6):  # 6: gone
                break
            time.sleep(0.2)
        shutil.rmtree(pw.pw_dir, ignore_errors=True)
        shutil.rmtree(f"/tmp/podman-run-{pw.pw_uid}", ignore_errors=True)
        shutil.rmtree(f"/tmp/pytest-of-{name}", ignore_errors=True)


def _as_user_selection(here: Path, files: list[str], markexpr: str) -> list[str]:
    """pytest's arguments for the cases of `files` a user's run takes: not the drivers (named
    `ordinary_user`), and only those the caller's own selection (`-m`) takes."""
    return [
        *(str(here / f) for f in files),
        "-k",
        "not ordinary_user",
        *(["-m", markexpr] if markexpr else []),
    ]


def pytest_as_user(
    user: str, python: str, here: Path, files: list[str], *, timeout: float, markexpr: str = ""
) -> str:
    """Run the cases of `files` (tests/ as `here`: the readable copy) not named `ordinary_user`
    and selected by `markexpr` (the caller's `-m`: the default run leaves `matrix` out) as `user`,
    on rootless Podman (FILA_CONTRACT_BACKEND=podman), with nothing of root's environment;
    pytest's output, once it has passed (the caller counts what ran: selected_as_user)."""
    env = podman_env(user, FILA_CONTRACT_BACKEND="podman")
    with tempfile.TemporaryDirectory(prefix="fila-podman-") as tmp:
        os.chmod(tmp, 0o777)
        argv = [*as_user(user, env), python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                f"--basetemp={tmp}/t", "--rootdir", str(here.parent),
                *_as_user_selection(here, files, markexpr)]  # fmt: skip
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


def selected_as_user(here: Path, files: list[str], markexpr: str = "") -> int:
    """How many cases pytest_as_user's selection holds, collected here the same way."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(here.parent), *_as_user_selection(here, files, markexpr)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "FILA_CONTRACT_BACKEND": "podman"},
    )  # fmt: skip
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", res.stdout)
    assert m is not None and int(m.group(1)) > 0, res.stdout[-3000:] + res.stderr[-3000:]
    return int(m.group(1))


# The start of a script run_as_podman_user runs: a queue root `q` on rootless Podman (its limits
# waived: cgroup v1 here), the shell image built, and `fila(...)`, the CLI as this user.
PODMAN_ROOT = r"""
import json, os, subprocess, sys, tempfile
from pathlib import Path
from fila.sandbox.podman.backend import PodmanBackend
CLI = [sys.executable, "-c", "from fila.cli import main; main()"]
def fila(*a):
    r = subprocess.run([*CLI, *a], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr
q = Path(tempfile.mkdtemp(prefix="fila-scratch-"))
(q / "greeting.txt").write_text("hello\n")
assert fila("init", "--root", str(q), "--backend", "podman")[0] == 0
pol = q / "policies" / "default.json"
pol.write_text(json.dumps(json.loads(pol.read_text()) | {"waive": ["memory", "pids", "cpus"]}))
b = PodmanBackend(); b.build("shell", progress=lambda _m: None); b.close()
"""


def run_as_podman_user(script: str) -> dict:
    """Run PODMAN_ROOT + `script` as a throwaway ordinary user with subordinate ids (rootless
    Podman); the JSON its last line prints. Skips where no such user or Python can be had."""
    if os.getuid() != 0:
        pytest.skip("creating an ordinary user for the test needs root")
    if shutil.which("podman") is None:
        pytest.skip("scripts/podman-up installs podman")
    python = python_for_others()
    if python is None:
        pytest.skip("no Python an ordinary user may run")
    with podman_user() as user, tempfile.TemporaryDirectory(prefix="fila-scratch-") as tmp:
        os.chmod(tmp, 0o755)
        path = Path(tmp) / "as_podman_user.py"
        path.write_text(PODMAN_ROOT + script)
        argv = [*as_user(user, podman_env(user)), python, str(path)]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            return json.loads(res.stdout.strip().splitlines()[-1])
        finally:
            for p in Path("/tmp").glob("fila-scratch-*"):
                if p.owner() == user:
                    shutil.rmtree(p, ignore_errors=True)
