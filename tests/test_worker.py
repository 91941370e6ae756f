"""The worker loop with real containers: the chain, concurrency, signals, the breaker, and a
Docker daemon that stops and starts mid-run (several worker processes on one queue: test_queue,
on the fake backend)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef, Status
from fila.queue import breaker
from fila.queue import store as queue
from fila.sandbox.docker.backend import DockerBackend
from tests.support.cli import CLI, submit_process
from tests.support.cli import fila_process as fila
from tests.support.containers import Starts, containers_left
from tests.support.crash import assert_one_state_each
from tests.support.project import make_root

S = Status
pytestmark = pytest.mark.docker


def submit(root: Root, tid: str, command: str, *extra: str) -> None:
    submit_process(root, tid, command, *extra, check=True)


def start_worker(
    root: Root, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [*CLI, "worker", *args],
        env={**os.environ, "FILA_ROOT": str(root.path), **(env or {})},
        stdout=out,
        stderr=out,
    )


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():  # type: ignore[operator]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def status_of(root: Root, tid: str) -> Status | None:
    rec = queue.read_record(root, tid)
    return rec.status if rec else None


def stop(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if p.poll() is None:
        p.send_signal(sig)
    try:
        return p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_one_worker_chains_tasks_idles_and_wakes_for_a_new_one(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts, tmp_path: Path
) -> None:
    for i in range(3):
        submit(proj, f"t{i}", f"echo {i} >> greeting.txt")
    w = start_worker(proj, log=tmp_path / "worker.log")
    try:
        wait_for(
            lambda: all(status_of(proj, f"t{i}") == S.needs_review for i in range(3)),
            60,
            "the three queued tasks",
        )
        time.sleep(1.5)  # idle: nothing queued
        assert w.poll() is None, "an idle worker keeps waiting"
        submit(proj, "late", "echo late >> greeting.txt")
        submitted = time.time()
        wait_for(
            lambda: any(e["event"] == "claimed" for e in queue.read_events(proj, "late")),
            5,
            "the new task to be claimed",
        )
        woke = time.time() - submitted
        wait_for(lambda: status_of(proj, "late") == S.needs_review, 30, "the late task")
    finally:
        code = stop(w)
    assert code == 0, (tmp_path / "worker.log").read_text()
    assert woke < 1.0, f"woke after {woke:.2f} s"
    workers = {queue.get_record(proj, t).worker for t in ["t0", "t1", "t2", "late"]}
    assert len({a.worker for t in ["t0", "late"] for a in queue.get_record(proj, t).attempts}) == 1
    assert workers == {None} or len(workers) == 1
    assert started_containers.count() == 4 and containers_left(docker_client, proj) == []


def test_concurrency_runs_jobs_at_the_same_time(proj: Root, tmp_path: Path) -> None:
    for i in range(3):
        submit(proj, f"t{i}", "sleep 2")
    t = time.monotonic()
    res = fila(proj, "run", "--once", "--concurrency", "3")
    took = time.monotonic() - t
    assert res.returncode == 0, res.stderr
    assert all(status_of(proj, f"t{i}") == S.needs_review for i in range(3))
    assert took < 5.5, f"three 2 s jobs took {took:.1f} s with --concurrency 3"


def test_sigterm_lets_the_running_job_finish_and_claims_nothing_more(
    proj: Root, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    submit(proj, "t0", "sleep 3; echo done >> greeting.txt")
    w = start_worker(proj, log=tmp_path / "worker.log")
    try:
        wait_for(lambda: queue.get_record(proj, "t0").container_started, 30, "the container")
        submit(proj, "t1", "true")
        code = stop(w, signal.SIGTERM, timeout=60)  # one SIGTERM: drain (a second one stops)
    finally:
        stop(w, signal.SIGKILL)
    assert code == 0, (tmp_path / "worker.log").read_text()
    assert status_of(proj, "t0") == S.needs_review, "the running job finished"
    assert status_of(proj, "t1") == S.queued and proj.queued_path("t1").exists()
    assert containers_left(docker_client, proj) == []


def test_ctrl_c_removes_the_container_and_records_the_task(
    proj: Root, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    submit(proj, "t0", "sleep 60")
    w = start_worker(proj, "--once", log=tmp_path / "worker.log")
    try:
        wait_for(lambda: queue.get_record(proj, "t0").container_started, 30, "the container")
        t = time.monotonic()
        code = stop(w, signal.SIGINT, timeout=30)
        took = time.monotonic() - t
    finally:
        stop(w, signal.SIGKILL)
    assert code == 130, (tmp_path / "worker.log").read_text()
    assert took < 10
    rec = queue.get_record(proj, "t0")
    assert rec.status == S.needs_human and rec.error and rec.error.kind == "interrupted"
    assert containers_left(docker_client, proj) == []
    assert_one_state_each(proj, ["t0"])
    assert not [p for d in (proj.in_dir, proj.run_dir, proj.state_dir) for p in d.glob(".*.tmp")]


def test_breaker_stops_claiming_until_rearmed(proj: Root, tmp_path: Path) -> None:
    pol = json.loads((proj.policies_dir / "default.json").read_text())
    pol["max_consecutive_failures"] = 2
    # Failures the task's author did not choose: the policy's own timeout on a command that
    # hangs (a shell command's own non-zero exit or its own timeout never counts).
    pol["default_timeout_ms"] = 1000
    (proj.policies_dir / "strict.json").write_text(json.dumps(pol))
    (proj.in_dir / "bad.json").write_text("{not json")  # invalid files do not count
    submit(proj, "ok0", "true", "--policy", "strict")
    for i in range(4):
        submit(proj, f"f{i}", "trap 'exit 0' TERM; sleep 30 & wait", "--policy", "strict")
    res = fila(proj, "run", "--once")
    assert res.returncode == 6, res.stderr
    recs = {r.id: r.status for r in queue.all_records(proj)}
    assert recs["bad"] == S.failed and recs["ok0"] == S.needs_review
    assert sorted(recs[f"f{i}"] for i in range(4)) == sorted([S.failed] * 2 + [S.queued] * 2)
    st = json.loads(fila(proj, "status", "--json", check=True).stdout)
    assert st["breaker"]["open"] and st["counts"]["queued"] == 2
    assert "OPEN" in fila(proj, "status", check=True).stdout
    assert fila(proj, "run", "--once").returncode == 6, "a new worker does not forget it"
    fila(proj, "rearm", "--by", "ana", "--reason", "engine fixed", check=True)
    events = [json.loads(x) for x in breaker.events_path(proj).read_text().splitlines()]
    assert [e["event"] for e in events] == ["tripped", "rearmed"] and events[1]["by"] == "ana"
    submit(proj, "ok1", "true", "--policy", "strict")
    res = fila(proj, "run", "--once")
    assert res.returncode == 6, "two more failures trip it again"
    assert not breaker.read(proj).open or breaker.read(proj).consecutive == 2


def test_run_once_without_docker_keeps_tasks_queued(proj: Root, tmp_path: Path) -> None:
    submit(proj, "t0", "true")
    env = {**os.environ, "FILA_ROOT": str(proj.path), "DOCKER_HOST": f"unix://{tmp_path}/no-such.sock"}
    res = subprocess.run([*CLI, "run", "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert status_of(proj, "t0") == S.queued and proj.queued_path("t0").exists()


@pytest.mark.slow
# -- a Docker daemon of our own, stopped and started mid-run ----------------------------------


class PrivateDocker:
    """A second dockerd with its own data root, socket and bridge: stopping it cannot disturb
    the machine's daemon or anyone else's containers. Stopped by its own pid."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sock = base / "d.sock"
        self.bridge = f"fila{os.getpid() % 100000}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode:
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
        log = open(self.base / "dockerd.log", "ab")  # noqa: SIM115
        # --bridge names our own interface: with --bridge=none dockerd deletes docker0.
        self.proc = subprocess.Popen(
            [
                "dockerd",
                "--data-root",
                str(self.base / "data"),
                "--exec-root",
                str(self.base / "x"),
                "--pidfile",
                str(self.base / "d.pid"),
                "-H",
                self.host,
                f"--bridge={self.bridge}",
                "--iptables=false",
                "--ip-masq=false",
                "--ip6tables=false",
                "--ip-forward=false",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while True:
            try:
                docker.DockerClient(base_url=self.host, timeout=10).close()  # it pings
                return
            except Exception:
                assert time.time() < deadline, (self.base / "dockerd.log").read_text()[-3000:]
                assert self.proc.poll() is None, (self.base / "dockerd.log").read_text()[-3000:]
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        subprocess.run(["umount", "-R", str(self.base / "data")], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def private_docker(
    docker_client: docker.DockerClient,
    shell_image: ImageRef,
) -> Iterator[PrivateDocker]:
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.fail("this test starts its own dockerd: it needs dockerd and root")
    base = Path(tempfile.mkdtemp(prefix="fd"))  # short: containerd's socket paths have a limit
    d = PrivateDocker(base)
    try:
        d.start()
        other = docker.DockerClient(base_url=d.host, timeout=120)
        # Saved by tag (Image.save() saves by id and loses the tag).
        other.images.load(b"".join(docker_client.api.get_image(shell_image.tag)))
        assert other.images.get(shell_image.tag)
        other.close()
        yield d
    finally:
        d.close()


@pytest.mark.slow
def test_docker_daemon_stopped_mid_run_and_started_again(
    proj: Root, private_docker: PrivateDocker, tmp_path: Path
) -> None:
    submit(proj, "long", "sleep 30")
    submit(proj, "next", "echo next >> greeting.txt")
    w = start_worker(proj, env={"DOCKER_HOST": private_docker.host}, log=tmp_path / "w.log")
    try:
        wait_for(lambda: queue.get_record(proj, "long").container_started, 60, "the container")
        private_docker.stop()  # the daemon goes away with the container running

        def fenced() -> bool:
            rec = queue.get_record(proj, "long")
            return rec.status == S.running and rec.error is not None

        # Its container cannot be confirmed gone: the task is not published as over (README,
        # Durability): it stays running, the failure in its record, its claim kept as `.reaped`.
        wait_for(fenced, 60, "the interrupted task to be fenced")
        assert [c.name.rsplit(".", 1)[1] for c in queue.claim_files(proj, "long")] == ["reaped"]
        time.sleep(2)
        assert status_of(proj, "next") == S.queued, "nothing is claimed while Docker is down"
        assert status_of(proj, "long") == S.running, "never decided while its container may run"
        private_docker.start()
        wait_for(lambda: status_of(proj, "next") == S.needs_review, 90, "the queued task")
        wait_for(lambda: status_of(proj, "long") == S.needs_human, 90, "recovery to decide the task")
        client = docker.DockerClient(base_url=private_docker.host, timeout=30)
        try:
            wait_for(
                lambda: not containers_left(client, proj),
                60,
                "recovery to remove the container the outage left",
            )
        finally:
            client.close()
        code = stop(w)
    finally:
        stop(w, signal.SIGKILL)
    log = (tmp_path / "w.log").read_text()
    assert code == 0, log
    assert_one_state_each(proj, ["long", "next"])
    rec = queue.get_record(proj, "long")
    assert rec.error and rec.error.kind == "infra" and rec.diagnosis
    assert "could not be removed" in rec.diagnosis and "fila retry" in rec.diagnosis
    assert "Docker does not answer" in log and "Docker answers again" in log


def test_breaker_counts_failures_not_interruptions_or_invalid_files(tmp_path: Path) -> None:
    from fila.core.models import ErrorInfo, Record, Task

    root = make_root(tmp_path)
    task = Task(engine="shell", command="true", targets=["x"])

    def rec(status: Status, kind: str | None = None) -> Record:
        return Record(
            id="t", status=status, task=task, error=ErrorInfo(kind=kind, message="m") if kind else None
        )  # type: ignore[arg-type]

    for r in (
        rec(S.failed, "engine_error"),
        rec(S.needs_human, "interrupted"),
        rec(S.failed, "invalid"),
        rec(S.needs_human, "infra"),
    ):
        breaker.record(root, r, worker="w")
    assert breaker.read(root).consecutive == 2
    breaker.record(root, rec(S.needs_review), worker="w")
    assert breaker.read(root).consecutive == 0
    for _ in range(5):
        breaker.record(root, rec(S.failed, "timeout"), worker="w")
    assert breaker.read(root).open


def test_a_job_stopped_before_its_container_starts_goes_back_to_the_queue(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts
) -> None:
    from fila.queue import retry
    from fila.run import job as cycle

    class Draining(cycle.Hooks):
        def before_start(self, container: str) -> None:
            raise cycle.Interrupted("the worker is stopping")

    submit(proj, "t0", "true")
    claim = queue.try_claim(proj, proj.queued_path("t0"), "w1")
    assert claim is not None
    rec = cycle.run_one(proj, claim, backend=DockerBackend(docker_client), hooks=Draining())
    assert rec is not None and rec.status == S.queued and proj.queued_path("t0").exists()
    assert rec.attempts[-1].outcome == "handed back" and retry.INFRA.tries(rec) == 0
    assert started_containers.count() == 0 and containers_left(docker_client, proj) == []


def test_start_up_does_not_wait_for_recovery(proj: Root) -> None:
    import fcntl

    submit(proj, "t0", "true")
    proj.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(proj.state_dir / ".recovery.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another recovery is busy
        res = fila(proj, "run", "--once", timeout=60)
    finally:
        os.close(fd)
    assert res.returncode == 0, res.stderr
    assert status_of(proj, "t0") == S.needs_review


def test_the_heartbeat_thread_marks_a_reaped_job_lost_so_its_next_check_stops_it(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from fila.queue import lease
    from fila.run import worker as wmod
    from tests.support.project import shell_task

    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    w = wmod.Worker(proj, backend=DockerBackend(None))
    queue.enqueue(proj, "t1", shell_task())
    c = queue.try_claim(proj, proj.queued_path("t1"), w.id)
    assert c is not None
    job = wmod._Job(w, c)
    w.active[c.name] = job
    beats = threading.Thread(target=w._heartbeats, daemon=True)
    beats.start()
    try:
        time.sleep(0.2)
        job.check()  # its claim is there: nothing to stop
        assert queue.win(c, "reaped")  # recovery takes the claim
        wait_for(job.lost.is_set, 5, "the heartbeat thread to notice")
        with pytest.raises(queue.LeaseLost):
            job.check()
    finally:
        w.stopped.set()
        beats.join(timeout=5)
