"""Crash injection: the real CLI SIGKILLs itself at each named point of the cycle
(fila.faults), `fila recover` runs, and the invariants must hold: every task in exactly one
state, none lost, no engine run twice without a person's `fila retry`, no container left.

Container starts are counted from the Docker daemon's own event stream, not from fila's records,
so a second run that fila failed to record would still be seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core import fsutil
from fila.core.faults import POINTS
from fila.core.layout import Root
from fila.core.models import Status
from fila.queue import store as queue
from fila.sandbox.fake import FakeBackend
from tests.support.cli import CLI
from tests.support.cli import fila_process as fila
from tests.support.containers import Starts, containers_left, volumes_left
from tests.support.crash import EXPECTED, assert_one_state_each
from tests.support.marks import quick_for

S = Status


def test_every_crash_point_is_named_and_tested() -> None:
    assert set(EXPECTED) | {"during_hand_back"} == set(POINTS)


class DockerSide:
    """What a crash left on Docker: the containers and work volumes of the root, and the starts
    counted from the daemon's event stream."""

    env: dict[str, str] = {}  # noqa: RUF012 (the real daemon: nothing to add)

    def __init__(self, client: docker.DockerClient, root: Root, starts: Starts) -> None:
        self.client, self.root, self.starts = client, root, starts

    def left(self) -> list[str]:
        return containers_left(self.client, self.root) + volumes_left(self.client, self.root)

    def count(self) -> int:
        return self.starts.count()


class FakeSide:
    """The same on the fake backend (boxes are files with fila's labels, each start a line of the
    backend's event log), for every fila process of the test (FILA_BACKEND=fake)."""

    def __init__(self, boxes: Path, root: Root) -> None:
        self.boxes, self.root = boxes, root
        self.env = {"FILA_BACKEND": "fake", "FILA_FAKE_DIR": str(boxes)}

    def left(self) -> list[str]:
        return [b.name for b in FakeBackend(self.boxes).find(root=str(self.root.path))]

    def count(self) -> int:
        return sum(e["event"] == "start" for e in FakeBackend(self.boxes).events())


# The points that differ in kind run on Docker: before the container, container created, container
# running, diff written (the quick tier's), and the one inside Docker's own removal. The others are
# the same path at another step (an exited box, a record half-written): the fake backend, whose
# boxes recovery finds and removes by the same labels.
KINDS = ("after_claim", "after_checkpoint", "during_run", "after_diff")
ON_DOCKER = (*KINDS, "during_removal")


@pytest.mark.docker
@pytest.mark.parametrize("point", quick_for(ON_DOCKER, *KINDS))
def test_sigkill_at_each_kind_of_point_then_recovery_keeps_every_invariant_on_docker(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts, point: str
) -> None:
    crash_recover_and_run_again(proj, point, DockerSide(docker_client, proj, started_containers))


@pytest.mark.parametrize("point", [p for p in EXPECTED if p not in ON_DOCKER])
def test_sigkill_at_every_other_point_then_recovery_keeps_every_invariant(
    root: Root, tmp_path: Path, point: str
) -> None:
    crash_recover_and_run_again(root, point, FakeSide(tmp_path / "boxes", root))


def crash_recover_and_run_again(proj: Root, point: str, side: DockerSide | FakeSide) -> None:
    env = side.env
    cmd = (
        "echo world >> greeting.txt; sleep 3"
        if point in ("after_container_start", "during_run")
        else "echo world >> greeting.txt"
    )
    fila(proj, "submit", "--id", "t1", "--engine", "shell", "--command", cmd, "--target", "greeting.txt",
         check=True, env_extra=env)  # fmt: skip
    crashed = fila(proj, "run", "--once", crash=point, env_extra=env)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    if point == "during_removal":  # the exited container (and an overlay's work volume) are still there
        assert side.left()
    rep = json.loads(fila(proj, "recover", "--json", check=True, env_extra=env).stdout)
    assert rep["docker"] == "ok", rep
    assert side.left() == [], "recovery removes what the crash left (containers, work volumes)"
    assert assert_one_state_each(proj, ["t1"]) == {"t1": EXPECTED[point]}
    rec = queue.get_record(proj, "t1")
    ran_before = side.count()
    assert ran_before <= 1
    events = [e["event"] for e in queue.read_events(proj, "t1")]
    assert "recovered" in events, "every reconciliation is an event in the task's log"

    # Whatever the crash left, the next worker neither loses the task nor silently reruns it.
    fila(proj, "run", "--once", env_extra=env)
    after = queue.get_record(proj, "t1")
    if EXPECTED[point] == S.queued:
        assert after.status == S.needs_review
        assert after.attempt == (1 if point == "after_claim" else 2), "a begun attempt counts"
        assert side.count() == 1, "exactly one run in total"
    else:
        assert after.status == rec.status, "a started task is never rerun without a person"
        assert side.count() == ran_before
    if EXPECTED[point] == S.needs_human:
        assert rec.diagnosis and "Nothing was run again" in rec.diagnosis
        fila(proj, "retry", "t1", "--by", "tester", check=True, env_extra=env)
        fila(proj, "run", "--once", check=True, env_extra=env)
        assert queue.get_record(proj, "t1").status == S.needs_review
        assert side.count() == ran_before + 1, "one more run per retry"
    if EXPECTED[point] == S.needs_review:
        assert (proj.path / after.patch_path).read_text().count("+world") == 1  # type: ignore[operator]
    assert side.left() == []


@pytest.mark.docker
def test_sigkill_during_a_hand_back_loses_nothing(
    proj: Root,
    docker_client: docker.DockerClient,
) -> None:
    # The job directory held by another process (a stalled worker): an infra error before the
    # container starts, so the worker hands the task back, and dies half-way through. (A pinned
    # image nobody built does not: that is the task's own failure.)
    fila(
        proj,
        "submit",
        "--id",
        "t1",
        "--engine",
        "shell",
        "--command",
        "true",
        "--target",
        "greeting.txt",
        check=True,
    )
    rec_path = proj.record_path("t1")
    data: dict[str, Any] = json.loads(rec_path.read_text())
    proj.meta("t1").mkdir(parents=True, exist_ok=True)
    lock = os.open(proj.meta("t1") / "job.lock", os.O_RDWR | os.O_CREAT, 0o644)
    # The worker waits queue/lease.py's JOB_LOCK_WAIT_S (15 s) for a held job lock, then gives the
    # task back; this one waits 1 s: the same infra error, sooner.
    hurried = (
        "import fila.queue.lease as lease; lease.JOB_LOCK_WAIT_S = 1.0; from fila.cli import main; main()"
    )
    env = {**os.environ, "FILA_ROOT": str(proj.path), "FILA_CRASH_AT": "during_hand_back"}
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        crashed = subprocess.run([sys.executable, "-c", hurried, "run", "--once"], env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(lock)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert queue.get_record(proj, "t1").status == S.running and proj.queued_path("t1").exists()
    fila(proj, "recover", "--json", check=True)
    assert assert_one_state_each(proj, ["t1"]) == {"t1": S.queued}
    assert data["status"] == "queued"


@pytest.mark.docker
def test_sigkill_of_a_busy_worker_with_two_jobs_settles_both(
    proj: Root, docker_client: docker.DockerClient
) -> None:
    for i in range(3):
        fila(
            proj,
            "submit",
            "--id",
            f"t{i}",
            "--engine",
            "shell",
            "--command",
            "sleep 30",
            "--target",
            "greeting.txt",
            check=True,
        )
    env = {**os.environ, "FILA_ROOT": str(proj.path)}
    p = subprocess.Popen(
        [*CLI, "worker", "--concurrency", "2"], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 60
        while sum(1 for r in queue.all_records(proj) if r.container_started) < 2:
            assert time.time() < deadline, "two containers should run at once"
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait()
    fila(proj, "recover", check=True)
    states = assert_one_state_each(proj, ["t0", "t1", "t2"])
    assert sorted(states.values()) == sorted([S.queued, S.needs_human, S.needs_human])
    assert containers_left(docker_client, proj) == []


# -- zombies: a worker frozen (SIGSTOP) at a point, its lease expired, then resumed (SIGCONT) ----


def frozen_worker(root: Root, point: str) -> subprocess.Popen[bytes]:
    """`fila run --once` that SIGSTOPs itself at `point` (FILA_CRASH_AT=<point>:stop). The
    caller must SIGKILL it in a `finally` (`kill_worker`). The stop freezes the whole process, so
    the test holds the root's recovery lock until then: the worker's own recovery pass (a thread
    of its own, racing the job) skips, and is never the frozen holder every later recovery would
    wait on."""
    env = {**os.environ, "FILA_ROOT": str(root.path), "FILA_CRASH_AT": f"{point}:stop"}
    with fsutil.file_lock(root.state_dir / ".recovery.lock"):
        p = subprocess.Popen(
            [*CLI, "run", "--once"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.time() + 60
        while _proc_state(p.pid) != "T":
            if p.poll() is not None or time.time() > deadline:
                kill_worker(p)
                pytest.fail(f"the worker did not stop at {point} (exit {p.returncode})")
            time.sleep(0.05)
    return p


def _proc_state(pid: int) -> str:
    """ "T" once every thread of the process is stopped."""
    states = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(FileNotFoundError, IndexError):
            states.add(stat.read_text().rpartition(")")[2].split()[0])
    return "T" if states == {"T"} else "?"


def kill_worker(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        p.kill()  # SIGKILL ends a stopped process too
    p.wait(timeout=30)


def expire_lease(root: Root, tid: str) -> None:
    """The frozen worker's heartbeat stopped long ago: its claim is stale by the lease TTL."""
    (claim,) = [p for p in queue.claim_files(root, tid) if p.suffix == ".json"]
    old = time.time() - 3600
    os.utime(claim, (old, old))


@pytest.mark.docker
@pytest.mark.parametrize("docker_at_recovery", ["down", "up"])
def test_a_zombie_worker_never_starts_its_engine_after_recovery_took_its_task(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts, docker_at_recovery: str
) -> None:
    fila(
        proj,
        "submit",
        "--id",
        "t1",
        "--engine",
        "shell",
        "--command",
        "echo world >> greeting.txt",
        "--target",
        "greeting.txt",
        check=True,
    )
    # Frozen with its container created and container_started=True durable, not yet started.
    p = frozen_worker(proj, "after_checkpoint")
    try:
        expire_lease(proj, "t1")
        assert len(containers_left(docker_client, proj)) == 1
        if docker_at_recovery == "down":
            rep = json.loads(
                fila(
                    proj, "recover", "--json", check=True, env_extra={"DOCKER_HOST": "unix:///nonexistent"}
                ).stdout
            )
            assert "undecided" in [a["action"] for a in rep["actions"]], rep
            fila(proj, "recover", "--no-docker", check=True)
            assert queue.get_record(proj, "t1").status == S.running, (
                "nobody decides while the container may still be started"
            )
            assert fila(proj, "reject", "t1", "--by", "tester").returncode != 0
        else:
            fila(proj, "recover", check=True)  # removes the container, then decides
            assert containers_left(docker_client, proj) == []
            assert queue.get_record(proj, "t1").status == S.needs_human
            fila(proj, "reject", "t1", "--by", "tester", check=True)
        os.kill(p.pid, signal.SIGCONT)
        p.wait(timeout=120)
    finally:
        kill_worker(p)
    assert started_containers.count() == 0, "the zombie never started the engine"
    fila(proj, "recover", check=True)
    if docker_at_recovery == "down":
        assert queue.get_record(proj, "t1").status == S.needs_human
        fila(proj, "reject", "t1", "--by", "tester", check=True)
    assert queue.get_record(proj, "t1").status == S.rejected
    assert not queue.claim_files(proj, "t1")
    assert containers_left(docker_client, proj) == []
    assert "+world" not in (proj.path / "greeting.txt").read_text()


@pytest.mark.docker
def test_a_zombie_worker_never_wipes_a_later_attempts_finished_job_directory(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts
) -> None:
    fila(
        proj,
        "submit",
        "--id",
        "t1",
        "--engine",
        "shell",
        "--command",
        "echo world >> greeting.txt",
        "--target",
        "greeting.txt",
        check=True,
    )
    p = frozen_worker(proj, "after_begin")  # running, attempt 1, no job directory yet
    try:
        expire_lease(proj, "t1")
        fila(proj, "recover", check=True)
        assert queue.get_record(proj, "t1").status == S.queued, "never started: requeued"
        fila(proj, "run", "--once", check=True)
        rec = queue.get_record(proj, "t1")
        assert rec.status == S.needs_review and rec.attempt == 2 and rec.patch_path
        patch = (proj.path / rec.patch_path).read_bytes()
        os.kill(p.pid, signal.SIGCONT)
        p.wait(timeout=120)
    finally:
        kill_worker(p)
    assert queue.get_record(proj, "t1") == rec, "the zombie changed nothing"
    assert (proj.path / rec.patch_path).read_bytes() == patch, "DIFF.patch is intact"
    assert started_containers.count() == 1
    events = [e for e in queue.read_events(proj, "t1") if e["event"] == "result discarded"]
    assert events, "the zombie's attempt ends as a discarded result"
    fila(proj, "apply", "t1", "--yes", "--by", "tester", check=True)
    assert (proj.path / "greeting.txt").read_text() == "hello\nworld\n"
    assert containers_left(docker_client, proj) == []


@pytest.mark.docker
def test_a_job_directory_rm_cannot_remove_fails_that_task_only_and_the_run_goes_on(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts
) -> None:
    """Through the console script's path (fila.entry, its fast exit): a SIGKILL after the exit,
    recovery, then a retry whose old job directory cannot be removed (an immutable file here; a
    rootless overlay's subordinate-uid scratch in the field)."""
    submit = [
        "submit",
        "--engine",
        "shell",
        "--command",
        "echo world >> greeting.txt",
        "--target",
        "greeting.txt",
    ]
    fila(proj, *submit, "--id", "a1", check=True, entry=True)
    crashed = fila(proj, "run", "--once", crash="after_exit", entry=True)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    fila(proj, "recover", check=True, entry=True)
    assert assert_one_state_each(proj, ["a1"]) == {"a1": S.needs_human}
    assert containers_left(docker_client, proj) == [], "recovered through the fast exit too"
    stuck = proj.job_dir("a1") / "stuck"
    stuck.write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("no immutable files here (chattr +i needs root and a filesystem that has them)")
    try:
        fila(proj, "retry", "a1", "--by", "tester", check=True, entry=True)
        fila(proj, *submit, "--id", "b2", check=True, entry=True)
        res = fila(proj, "run", "--once", entry=True)
        # Allowed: the other task runs in the same `run --once`.
        assert queue.get_record(proj, "b2").status == S.needs_review, res.stderr
        rec = queue.get_record(proj, "a1")
        assert rec.status == S.failed and rec.error is not None and rec.error.kind == "infra", rec
        assert f"could not remove {proj.job_dir('a1')}" in rec.error.message
        assert "Operation not permitted" in rec.error.message, "rm's own stderr"
        assert "then `fila retry ID`" in rec.error.message, "and what to do"
        assert "fila bug" not in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert res.returncode == 1, res.stderr  # some task failed: not Docker's exit 3, not a crash
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=False)
    assert containers_left(docker_client, proj) == []
