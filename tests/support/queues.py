"""The two queues behind one small driver each, for the acceptance tests both must pass
(tests/test_queue_acceptance.py): the file queue under one root (docs/architecture.md, "The
queue's contract") and the PostgreSQL queue (docs/scale-out.md), whose submitter, runner hosts and
reviewer each have a root of their own.

Every command is the real `fila` CLI in a process of its own, on the fake backend (no containers:
sandbox/fake.py), whose boxes and starts are files a test reads apart from fila's records. What the
drivers hide are the differences that are not the promise: where a command runs (one root, or the
submitter's, a runner's and a reviewer's), what a runner is (`fila run`/`fila worker` on the root,
or `fila worker --queue` with its own `--root` and `--host-id`), and what settles a crashed worker
(`fila recover`, or a lapsed lease and the sweep every runner makes before it claims).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fila.core.layout import Root
from fila.sandbox.fake import FakeBackend
from tests.support.project import make_project, make_root

CLI = [sys.executable, "-m", "fila"]
# fila on a host whose fake engine has only the images FILA_FAKE_IMAGES names (fake_host.py).
SOME_IMAGES = [sys.executable, "-m", "tests.support.fake_host"]
REPO = Path(__file__).resolve().parents[2]
NOTES = "".join(f"line {i}\n" for i in range(1, 11))
FILES = {"notes.txt": NOTES}  # beside greeting.txt: a file where a moved base still merges
LEASE_S = 3.0  # a runner's lease (the least `fila worker --queue` takes): a killed one lapses soon
# A route's credential, for a task whose policy has one: what is checked is that it is set.
PLACEHOLDER_KEY = "sk-placeholder-not-a-key"
TIMEOUT_S = 60.0  # one command's bound: far above what any takes here (a second or two)


def wait_for(pred: Callable[[], bool], timeout: float = 30.0, what: str = "the condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def base_env() -> dict[str, str]:
    """This process's environment without what would choose for the test (a crash point, a root,
    a queue, libpq's settings), with the fake backend and a placeholder key."""
    drop = ("FILA_", "PG")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"FILA_BACKEND": "fake", "OPENAI_API_KEY": PLACEHOLDER_KEY, "PYTHONPATH": str(REPO)})
    return env


class Driver(abc.ABC):
    """What a test does with a queue, the same on both (see the module docstring)."""

    name: str
    base: Path  # the test's directory
    project: Root  # the submitter's project: the targets are read here
    reviewer: Root  # where `fila apply` lands a patch

    @abc.abstractmethod
    def fila(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A review command (ls, show, diff, logs, apply, reject, retry, status) from the reviewer."""

    @abc.abstractmethod
    def submit_task(self, tid: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`fila submit --id TID ARGS...` from the submitter."""

    @abc.abstractmethod
    def run_once(self, *, host: str = "h1", crash: str | None = None) -> subprocess.CompletedProcess[str]:
        """One worker or runner on `host` that processes what is queued, then exits (SIGKILLed at
        the fault point `crash`, core/faults.py)."""

    @abc.abstractmethod
    def runner(self, *, images: list[str] | None = None) -> contextlib.AbstractContextManager[None]:
        """A long-running worker or runner in the background (its engine with only the `images` of
        those engines, when given), stopped by SIGTERM at the end, which it answers with exit 0."""

    @abc.abstractmethod
    def runs_submitted(self) -> contextlib.AbstractContextManager[None]:
        """Whoever runs the task of a `fila submit --run`, while it is there."""

    @abc.abstractmethod
    def settle(self, tid: str) -> None:
        """What settles a worker SIGKILLed while it held `tid`, until its task has a new state."""

    @abc.abstractmethod
    def state(self, tid: str) -> str:
        """The task's status now, read from the queue itself (cheap, for waits and checks in
        between; `record` is what `fila show --json` says)."""

    @abc.abstractmethod
    def starts(self) -> int:
        """Boxes started on every host so far, from the fake backend's own event logs."""

    @abc.abstractmethod
    def left(self) -> list[str]:
        """Boxes still there on every host (a container nobody removed)."""

    def submit(
        self, tid: str, command: str, *extra: str, target: str = "greeting.txt"
    ) -> subprocess.CompletedProcess[str]:
        """`fila submit` of a shell task on `target`; `extra` are more of submit's options."""
        return self.submit_task(tid, "--engine", "shell", "--command", command, "-t", target, *extra)

    def submit_file(self, tid: str, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        """`fila submit --id TID FILE` of the task document `doc` (written under the test's
        directory), e.g. one member of a group of shell tasks."""
        path = self.base / f"{tid}.task.json"
        path.write_text(json.dumps(doc))
        return self.submit_task(tid, str(path))

    @abc.abstractmethod
    def review_html(self, tid: str) -> Path:
        """Where `fila review TID --html` writes REVIEW.html."""

    def record(self, tid: str) -> dict[str, Any]:
        """The task's record, as `fila show --json` prints it."""
        res = self.fila("show", tid, "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _with_crash(env: dict[str, str], crash: str | None) -> dict[str, str]:
    return {**env, "FILA_CRASH_AT": crash} if crash else env


class _Background:
    """A worker process, its stderr in a file; stopped by SIGTERM."""

    def __init__(self, argv: list[str], env: dict[str, str], err: Path) -> None:
        self.err = err
        with open(err, "wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=f)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        finally:
            self.proc.kill()
            self.proc.wait(10)
        assert code == 0, (code, self.err.read_text())


class FileDriver(Driver):
    """The file queue: one root is the project, the workers' queue and the reviewer's; every
    worker is a process on that root (a `host` names none)."""

    name = "file"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.project = self.reviewer = make_project(base / "project", FILES)
        self.boxes = base / "boxes"
        self.env = {**base_env(), "FILA_FAKE_DIR": str(self.boxes)}

    def fila(self, *args: str, crash: str | None = None) -> subprocess.CompletedProcess[str]:
        return _run([*CLI, *args, "--root", str(self.project.path)], _with_crash(self.env, crash))

    def submit_task(self, tid: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.fila("submit", "--id", tid, *args)

    def run_once(self, *, host: str = "h1", crash: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.fila("run", "--once", crash=crash)

    @contextlib.contextmanager
    def runner(self, *, images: list[str] | None = None) -> Iterator[None]:
        argv = [*(SOME_IMAGES if images is not None else CLI), "worker", "--poll", "0.2"]
        env = {**self.env, "FILA_FAKE_IMAGES": ",".join(images or [])}
        w = _Background([*argv, "--root", str(self.project.path)], env, self.base / "worker.err")
        try:
            yield
        finally:
            w.stop()

    @contextlib.contextmanager
    def runs_submitted(self) -> Iterator[None]:
        yield  # `fila submit --run` runs its task in the submitting process itself

    def review_html(self, tid: str) -> Path:
        return self.project.job_dir(tid) / "REVIEW.html"  # in the job directory

    def settle(self, tid: str) -> None:
        res = self.fila("recover", "--json")
        assert res.returncode == 0, res.stdout + res.stderr

    def state(self, tid: str) -> str:
        path = self.project.record_path(tid)
        return json.loads(path.read_text())["status"] if path.exists() else "missing"

    def starts(self) -> int:
        return sum(e["event"] == "start" for e in FakeBackend(self.boxes).events())

    def left(self) -> list[str]:
        return [b.name for b in FakeBackend(self.boxes).find()]


class PgDriver(Driver):
    """The PostgreSQL queue at `url`: a submitter's project, runner hosts (each its own root, host
    id and fake engine's state under base/HOST) and a reviewer's checkout of the same project."""

    name = "pg"

    def __init__(self, base: Path, url: str) -> None:
        from fila.queue.pg.store import PgQueue as Store

        self.base, self.url = base, url
        self.project = make_project(base / "submitter", FILES)
        self.reviewer = make_project(base / "reviewer", FILES)
        self.env = base_env()
        self.db = Store(url, reconnect_s=20)  # the test's own look at the database (waits, sweep)

    def close(self) -> None:
        self.db.close()

    def host(self, name: str) -> tuple[Root, dict[str, str]]:
        """A runner host's root and environment (its own fake engine's state)."""
        path = self.base / name
        root = Root.at(path) if (path / "fila").is_dir() else make_root(path)
        return root, {**self.env, "FILA_FAKE_DIR": str(self.base / f"{name}.boxes")}

    def fila(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _run([*CLI, *args, "--queue", self.url, "--root", str(self.reviewer.path)], self.env)

    def submit_task(self, tid: str, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [*CLI, "submit", "--id", tid, *args, "--queue", self.url, "--root", str(self.project.path)]
        return _run(argv, self.env)

    def _runner_argv(self, name: str, root: Root, cli: list[str]) -> list[str]:
        return [*cli, "worker", "--queue", self.url, "--root", str(root.path), "--host-id", name,
                "--lease", str(LEASE_S)]  # fmt: skip

    def run_once(self, *, host: str = "h1", crash: str | None = None) -> subprocess.CompletedProcess[str]:
        root, env = self.host(host)
        return _run([*self._runner_argv(host, root, CLI), "--once"], _with_crash(env, crash))

    @contextlib.contextmanager
    def runner(self, *, images: list[str] | None = None) -> Iterator[None]:
        root, env = self.host("h1")
        argv = self._runner_argv("h1", root, SOME_IMAGES if images is not None else CLI)
        env = {**env, "FILA_FAKE_IMAGES": ",".join(images or [])}
        w = _Background([*argv, "--poll", "0.2"], env, self.base / "h1.err")
        try:
            yield
        finally:
            w.stop()

    def review_html(self, tid: str) -> Path:
        return self.reviewer.fila / "reviews" / tid / "REVIEW.html"  # no job directory here

    def runs_submitted(self) -> contextlib.AbstractContextManager[None]:
        return self.runner()  # `fila submit --queue --run` waits for a runner's publish

    def settle(self, tid: str) -> None:
        """The killed runner's lease lapses on the database's clock, and the sweep every runner makes
        before it claims (PgQueue.sweep) decides the task: here alone, so the test sees the decision
        before any claim, and without the backoff a requeue waits. Then `fila recover` on each
        runner host removes what the killed runner left there (its job root, whose lock nobody
        holds, and the box in it), as its operator would, or its next start does."""
        from fila.queue.retry import RetryPolicy

        now = RetryPolicy(attempts=None, base=0.0, cap=0.0, jitter=False)
        wait_for(lambda: self.db.task_state(tid)["lease_expires_at"] <= self.db.clock(), 30,
                 f"{tid}'s lease to lapse")  # fmt: skip
        decided = self.db.sweep(policy=now)
        assert [t for t, _st in decided] == [tid], decided
        hosts = [p for p in sorted(self.base.glob("h*")) if (p / "fila").is_dir()]
        for path in hosts:
            root, env = self.host(path.name)
            res = _run([*CLI, "recover", "--root", str(root.path), "--json"], env)
            assert res.returncode == 0, res.stdout + res.stderr
        assert hosts and not [p for h in hosts for p in (h / "remote").glob(f"{tid}.*")]

    def state(self, tid: str) -> str:
        return self.db.get(tid).status.value

    def _fakes(self) -> list[FakeBackend]:
        return [FakeBackend(p) for p in sorted(self.base.glob("h*.boxes"))]

    def starts(self) -> int:
        return sum(e["event"] == "start" for f in self._fakes() for e in f.events())

    def left(self) -> list[str]:
        return [b.name for f in self._fakes() for b in f.find()]
