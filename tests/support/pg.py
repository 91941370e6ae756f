"""A throwaway PostgreSQL cluster for the PostgreSQL queue's tests: Debian's server binaries
(scripts/postgres-up installs them), `initdb -A trust` in a temporary directory, listening only on
a unix socket there (listen_addresses=''), run as an ordinary user when the tests run as root
(initdb refuses root). Never a mock: the queue's promises are about PostgreSQL's own locking and
clock. The session fixture `pg_cluster` (tests/conftest.py) starts one and stops it at the end."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def pg_bindir() -> Path | None:
    """The newest Debian PostgreSQL's bin directory, or None when none is installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


class Cluster:
    """One cluster in `base`: data in base/data, the socket in base/sock, the log in base/log."""

    def __init__(self, bindir: Path, base: Path, user: str | None) -> None:
        self.bindir, self.base, self.user = bindir, base, user
        self.data, self.sock, self.log = base / "data", base / "sock", base / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def _run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=self.base, **self._as_user()
        )
        if check and res.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} failed ({res.returncode}): {res.stdout}{res.stderr}{self.log_tail()}"
            )
        return res

    def _as_user(self) -> dict[str, Any]:
        """subprocess arguments: the server's user with no supplementary groups (root's are not
        inherited), and a plain environment."""
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        if not self.user:
            return {"env": env}
        pw = pwd.getpwnam(self.user)
        return {"env": env, "user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n" + self.log.read_text()[-2000:]
        return ""

    def init(self) -> None:
        self.sock.mkdir()
        if self.user:
            shutil.chown(self.sock, self.user)
        self._run(str(self.bindir / "initdb"), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--locale=C", "--no-sync", "-D", str(self.data))  # fmt: skip
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                f"\nlisten_addresses = ''\nunix_socket_directories = '{self.sock}'\n"
                "max_connections = 100\nshared_buffers = 16MB\nlog_min_messages = warning\n"
                # A killed server loses nothing without fsync (the page cache survives it); a
                # machine crash is not what these tests are about, and fsync costs ~10 ms a commit.
                "fsync = off\n"
            )

    def start(self) -> None:
        """Start the server as this process's own child (so a SIGKILLed postmaster is reaped here
        at once, not left a zombie that holds its pid), then wait until it accepts connections.
        After a kill -9 the old backends may hold the shared memory a moment: it tries again."""
        import psycopg

        for _ in range(100):
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen(
                    [str(self.bindir / "postgres"), "-D", str(self.data)],
                    stdout=log, stderr=log, cwd=self.base, **self._as_user(),
                )  # fmt: skip
            while self.proc.poll() is None:
                with contextlib.suppress(psycopg.OperationalError):
                    psycopg.connect(self.url(), connect_timeout=2).close()
                    return
                time.sleep(0.02)
            time.sleep(0.1)
        raise RuntimeError(f"the PostgreSQL server does not start{self.log_tail()}")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self) -> None:
        """`pg_ctl stop -m fast`, then a new server: a clean restart."""
        self.stop("fast")
        self.start()

    def kill9(self) -> None:
        """SIGKILL the postmaster (its backends notice and exit on their own)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql:///{dbname}?host={self.sock}&user=postgres"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def new_queue(self) -> tuple[str, str]:
        """A fresh, empty queue: (its URL, its schema). Each test gets its own schema in one
        database (`options=-csearch_path=...` in the URL): nothing leaks between tests, and no
        database is copied and removed per test (a few hundred ms each on a busy disk)."""
        name = "t_" + uuid.uuid4().hex[:12]
        self.admin(f"CREATE SCHEMA {name}")
        return f"{self.url()}&options=-csearch_path%3D{name}", name

    def new_database(self) -> str:
        """A fresh empty queue's URL (see new_queue)."""
        return self.new_queue()[0]


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    """A started cluster, stopped and removed at the end. As root, it runs as `nobody`."""
    bindir = pg_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL server: run scripts/postgres-up (apt-get install postgresql)")
    user = "nobody" if os.getuid() == 0 else None
    base = Path(tempfile.mkdtemp(prefix="fila-pg-"))
    if user:
        shutil.chown(base, user)
    c = Cluster(bindir, base, user)
    try:
        c.init()
        c.start()
        yield c
    finally:
        c.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


def tamper_blob(url: str, sha: str, old: bytes, new: bytes) -> None:
    """Blob `sha`'s bytes changed behind fila's back (`old` replaced by `new`), its hash check
    constraint dropped first: what a reader must refuse (BlobMismatch, exit 4)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE fila_blobs DROP CONSTRAINT IF EXISTS fila_blobs_hash")
        row = conn.execute("SELECT data FROM fila_blobs WHERE sha256 = %s", (sha,)).fetchone()
        data = bytes(row[0]) if row is not None else b""
        assert old in data, f"blob {sha} has no {old!r}"
        conn.execute("UPDATE fila_blobs SET data = %s WHERE sha256 = %s", (data.replace(old, new), sha))


def clear_backoff(url: str, task_id: str) -> None:
    """Task `task_id` claimable now: its backoff (`not_before`) cleared, as if it had passed."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE fila_tasks SET not_before = NULL WHERE id = %s", (task_id,))
