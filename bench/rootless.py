"""Rootless Podman for a bench case (`--backend podman`): as root, a throwaway ordinary user
(subordinate ids from useradd, no docker group) whose Podman the case runs, the images Docker has
loaded into that user's storage, and the case's user side run as that user in its own Python. The
user, its processes and its files are removed after. Used by bench/per_task.py and
bench/egress_startup.py."""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, Ctx

# Rootless Podman on cgroup v1 cannot enforce these: fila refuses a policy unless it waives them,
# and leaves them out of the container (and of the gateway) once waived.
WAIVED = ["memory", "pids", "cpus"]


@dataclass
class User:
    name: str
    uid: int
    home: Path
    env: dict[str, str]  # what each command as the user runs with (env -i)
    entry: str  # the module whose `as_user(argv)` is the case's user side

    def argv(self, *cmd: str) -> list[str]:
        return [
            "runuser",
            "-u",
            self.name,
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in self.env.items()),
            *cmd,
        ]

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """A command as the user, in its home; it must succeed."""
        return subprocess.run(
            self.argv(*cmd), capture_output=True, text=True, cwd=self.home, check=True, timeout=120
        )

    def py(self, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        """The case's user side (`<entry>.as_user(args)`), in the user's Python, in its home."""
        code = f"import sys; from {self.entry} import as_user; as_user(sys.argv[1:])"
        argv = self.argv(self.env["FILA_BENCH_PYTHON"], "-c", code, *args)
        p = subprocess.run(argv, capture_output=True, text=True, cwd=self.home, check=False, **kw)  # type: ignore[call-overload]
        if p.returncode != 0:
            raise RuntimeError(f"bench as {self.name}: {' '.join(args)[:200]} exited {p.returncode}: "
                               f"{(p.stdout + p.stderr)[-2000:]}")  # fmt: skip
        return p

    def load_images(self, *images: str) -> None:
        """Docker's very images into the user's Podman storage (`docker save | podman load`):
        no second build (a rootless build of the gateway has no network for PyPI)."""
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        load = subprocess.run(self.argv("podman", "load"), stdin=save.stdout, capture_output=True, text=True,
                              cwd=self.home, timeout=600, check=False)  # fmt: skip
        if save.wait() != 0 or load.returncode != 0:
            raise RuntimeError(f"bench: `docker save {' '.join(images)} | podman load` as {self.name} "
                               f"failed: {load.stderr[-1000:]}")  # fmt: skip


def _readable(p: Path) -> bool:
    """o+r on it, o+x on every directory above it (what an ordinary user needs to import it)."""
    p = p.resolve()
    return bool(os.stat(p).st_mode & 0o004) and all(os.stat(d).st_mode & 0o001 for d in p.parents)


def _python_for_others(tmp: Path) -> tuple[str, str]:
    """(a Python of this version an ordinary user may run, PYTHONPATH with fila, its packages and
    bench/): this checkout's when readable by others, else a 0755 copy under `tmp`."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cands = (Path(sys.executable), Path(f"/usr/bin/python{version}"))
    python = next((str(c) for c in cands if c.exists() and _readable(c)), None)
    if python is None:
        raise SystemExit(f"bench: --backend podman needs a Python {version} an ordinary user may run")
    import fila

    src = Path(fila.__file__).parent.parent
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    if (
        _readable(src / "fila" / "__init__.py")
        and _readable(site)
        and _readable(REPO / "bench" / "__init__.py")
    ):
        return python, f"{src}:{site}:{REPO}"
    base = tmp / "runtime"
    for name, frm in (("src/fila", src / "fila"), ("site", site), ("repo/bench", REPO / "bench"),
                      ("src/policies", REPO / "policies"), ("src/images", REPO / "images")):  # fmt: skip
        if frm.exists():
            shutil.copytree(frm, base / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return python, f"{base / 'src'}:{base / 'site'}:{base / 'repo'}"


@contextlib.contextmanager
def podman_user(ctx: Ctx, entry: str, *, storage: str | None = None) -> Iterator[User]:
    """A throwaway ordinary user for the run (as the Podman tests make one), whose commands run
    `entry`'s `as_user`, and everything it left removed afterwards: its processes (its Podman
    service, conmon), its home (Podman's storage) and runtime directory. `storage`: the storage
    driver its Podman uses (its own storage.conf), else the host's default."""
    if os.getuid() != 0:
        raise SystemExit("bench: --backend podman runs as root (it makes an ordinary user to run Podman as)")
    if shutil.which("podman") is None:
        raise SystemExit("bench: --backend podman needs podman (scripts/podman-up installs it)")
    os.chmod(ctx.tmp, 0o711)  # the user reaches its own directory below the bench's
    python, path = _python_for_others(ctx.tmp)
    name = f"filabench{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--user-group", name],
                   check=True, capture_output=True)  # fmt: skip
    pw = pwd.getpwnam(name)
    try:
        if storage is not None:
            conf = Path(pw.pw_dir) / ".config" / "containers"
            conf.mkdir(parents=True)
            (conf / "storage.conf").write_text(f'[storage]\ndriver = "{storage}"\n')
            subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(conf.parent)], check=True)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": pw.pw_dir,
            "PYTHONPATH": path,
            "PYTHONDONTWRITEBYTECODE": "1",
            "FILA_BACKEND": "podman",
            "FILA_BENCH_PYTHON": python,
        }
        yield User(name, pw.pw_uid, Path(pw.pw_dir), env, entry)
    finally:
        _end_user(name, pw.pw_uid)
        shutil.rmtree(pw.pw_dir, ignore_errors=True)
        shutil.rmtree(f"/tmp/podman-run-{pw.pw_uid}", ignore_errors=True)


def _end_user(name: str, uid: int) -> None:
    """Kill the processes of the user made here (only theirs) and remove the user: userdel refuses
    while one is left, and a SIGKILL is not instant, so until it succeeds (10 s at most)."""
    for _ in range(50):
        pids = subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        if subprocess.run(["userdel", name], capture_output=True, check=False).returncode in (0, 6):
            return  # 6: no such user
        time.sleep(0.2)
    print(f"bench: could not remove the user {name}: `userdel {name}` as root", file=sys.stderr)
