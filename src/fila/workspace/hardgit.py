"""git, hardened, for the two places fila runs it on engine-written files: the diff (workspace/diff.py) and
apply (review/apply.py).

git runs in a throwaway bare repository with an environment built from nothing: no system or
global configuration, no hooks, no fsmonitor, no attributes from any file fila did not write
(GIT_ATTR_SOURCE: the empty tree, git >= 2.40; `attr.tree` below, >= 2.42), no replace objects,
no prompts, the C locale. Callers add their own `-c` options (the diff's pack tuning, apply's
line-ending and path-protection settings) and, for apply, an `info/attributes` that disables every
filter and conversion.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Generator
from pathlib import Path

from ..core.errors import InfraError
from .fswalk import escape_name

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's well-known empty tree
BASE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=",
    "-c", "core.attributesFile=/dev/null",
    "-c", f"attr.tree={EMPTY_TREE}",  # git >= 2.42 reads a bare repository's HEAD:.gitattributes
)  # fmt: skip


def environment(home: Path, git_dir: Path) -> dict[str, str]:
    path = os.environ.get("PATH", os.defpath)
    return {
        "PATH": path,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home),
        "GIT_DIR": str(git_dir),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_ATTR_SOURCE": EMPTY_TREE,
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_TERMINAL_PROMPT": "0",
        "LC_ALL": "C",
    }


class Git:
    """git in the bare repository `home/repo.git` (created on first use). Its stderr goes to
    `home/git-stderr.log` for `popen`, so nobody has to drain a pipe; `run` captures it."""

    def __init__(
        self, home: Path, *, purpose: str, config: tuple[str, ...] = (), attributes: str | None = None
    ) -> None:
        self.home = home
        self.dir = home / "repo.git"
        self.log = home / "git-stderr.log"
        exe = shutil.which("git", path=os.environ.get("PATH", os.defpath))
        if exe is None:
            raise InfraError("git is not installed", hint=f"install git; fila uses it for {purpose}")
        self.exe = exe
        self.config = (*BASE_CONFIG, *config)
        self.env = environment(home, self.dir)
        if not self.dir.exists():
            self.run(["init", "--bare", "--quiet", "--template=", str(self.dir)])
            if attributes is not None:  # info/attributes wins over any .gitattributes in a tree
                (self.dir / "info").mkdir(exist_ok=True)
                (self.dir / "info" / "attributes").write_text(attributes)

    def popen(
        self, args: list[str], *, stdin: int = subprocess.DEVNULL, stdout: int = subprocess.PIPE
    ) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as err:
            return subprocess.Popen(
                [self.exe, *self.config, *args],
                env=self.env,
                cwd=self.home,
                stdin=stdin,
                stdout=stdout,
                stderr=err,
            )

    def run(
        self, args: list[str], *, work_tree: Path | None = None, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[bytes]:
        env = dict(self.env)
        if work_tree is not None:
            env["GIT_WORK_TREE"] = str(work_tree)
        res = subprocess.run(
            [self.exe, *self.config, *args],
            env=env,
            capture_output=True,
            cwd=work_tree or self.home,
            timeout=timeout,
            check=False,
        )
        if check and res.returncode != 0:
            raise InfraError(f"git {args[0]} failed (exit {res.returncode}): {tail(res.stderr)}")
        return res

    def collect(self, proc: subprocess.Popen[bytes], what: str) -> bytes:
        out, _ = proc.communicate()
        self.check(proc, what)
        return out

    def stream(self, args: list[str]) -> Generator[bytes, None, None]:
        """git's stdout in chunks; the exit status is checked at the end, and git is killed if
        the reader stops early (a patch over the limit)."""
        proc = self.popen(args)
        assert proc.stdout is not None
        try:
            while chunk := proc.stdout.read(1 << 16):
                yield chunk
            self.check(proc, f"git {args[0]}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()

    def check(self, proc: subprocess.Popen[bytes], what: str) -> None:
        if proc.wait() != 0:
            raise InfraError(f"{what} failed (exit {proc.returncode}): {tail(self.log.read_bytes())}")


def tail(err: bytes) -> str:
    return escape_name(err.decode("utf-8", "replace").strip()[-1500:]).replace("\\n", "; ")
