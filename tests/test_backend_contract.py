"""One contract for every container backend, against the real engine (huey's StorageTests style).

Docker runs it here, as root, and so does the fake backend (sandbox/fake.py: no containers).
Rootless Podman runs the same tests as an unprivileged user the tests create:
tests/test_podman.py starts this module in a process of that user with
FILA_CONTRACT_BACKEND=podman (the backend fixture then yields Podman only). Each test is one
promise the cycle, the worker and recovery rely on: a hardened run, the host's timeout, the
limits (enforced, or refused before any container unless waived), removal and the sweep by
label, image lookup and build, and a clear error when the engine does not answer. The fake
keeps every promise but the container's own (hardening, ulimits, cgroup limits), which those
tests skip for it by name.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fila.core.errors import EngineUnavailable, InfraError, InvalidPolicy
from fila.core.models import ImageRef, Policy
from fila.sandbox import Backend, RunSpec, get_backend
from fila.sandbox.base import JOB_LABEL, ROOT_LABEL, StopRun
from fila.sandbox.fake import FakeBackend
from fila.workspace.strategy import CopyWorkspace

ENV = "FILA_CONTRACT_BACKEND"
SHELL = "fila/shell:latest"


def _names() -> list[object]:
    chosen = os.environ.get(ENV)
    if chosen:
        return [pytest.param(chosen, marks=pytest.mark.docker)]
    # podman: as an unprivileged user, through tests/test_podman.py
    return [pytest.param("docker", marks=pytest.mark.docker), "fake"]


@pytest.fixture(scope="module", params=_names())
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    # The fake is never a root's backend nor get_backend's without FILA_BACKEND: passed as an instance.
    b = (
        FakeBackend(tmp_path_factory.mktemp("boxes"))
        if request.param == "fake"
        else get_backend(request.param)
    )
    try:
        yield b
    finally:
        b.close()


def needs_a_container(backend: Backend) -> None:
    """Skip a promise only a container keeps: the fake runs commands on the host, unconfined."""
    if isinstance(backend, FakeBackend):
        pytest.skip(
            "hardening, ulimits and cgroup limits are a container's: the fake backend is not a sandbox"
        )


@pytest.fixture(scope="module")
def shell(backend: Backend) -> ImageRef:
    """The shell image on this backend: built when missing (a fresh user's Podman has none)."""
    ref = backend.build("shell", progress=lambda _m: None)
    assert ref.id and backend.image(SHELL) == ref
    return ref


def policy(**kw: object) -> Policy:
    base: dict[str, object] = dict(max_timeout_ms=60_000, default_timeout_ms=10_000, grace_ms=1000)
    return Policy.model_validate(base | kw)


def waiving(backend: Backend, **kw: object) -> Policy:
    """A policy this backend runs on this host: it waives what the host cannot enforce."""
    p = policy(**kw)
    return policy(**kw, waive=backend.unenforceable(p))


def spec(tmp_path: Path, script: str, p: Policy, *, timeout_ms: int = 20_000) -> RunSpec:
    job_id = f"c-{uuid.uuid4().hex[:12]}"
    job_dir = tmp_path / "jobs" / job_id
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()
    (job_dir / "input" / "a.txt").write_text("pristine\n")
    (job_dir / "work" / "a.txt").write_text("pristine\n")
    (job_dir / "TASK.md").write_text("contract\n")
    return RunSpec(
        job_id=job_id,
        workspace=CopyWorkspace(job_dir),
        image=SHELL,
        argv=["/bin/sh", "-c", script],
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
        policy=p,
        limits=None,
        timeout_ms=timeout_ms,
        log_path=tmp_path / "logs" / f"{job_id}.log",
        labels={ROOT_LABEL: str(tmp_path), "fila.worker": "contract"},
    )


def log(s: RunSpec) -> str:
    return s.log_path.read_text(errors="replace")


HARDENED = (
    'echo "uid=$(id -u)"; grep -E "^(CapEff|NoNewPrivs|Seccomp):" /proc/self/status; '
    "echo ifaces: $(ls /sys/class/net); "
    'echo changed > /job/work/a.txt && echo "work=ok"; '
    'touch /rootfs-file 2>/dev/null || echo "root=ro"; '
    'echo x > /job/input/a.txt 2>/dev/null || echo "input=ro"; '
    'echo x > /job/TASK.md 2>/dev/null || echo "task=ro"'
)


def test_a_run_is_hardened_and_only_work_is_writable(
    backend: Backend, shell: ImageRef, tmp_path: Path
) -> None:
    needs_a_container(backend)
    s = spec(tmp_path, HARDENED, waiving(backend))
    res = backend.run(s)
    out = log(s)
    assert res.exit_code == 0 and not res.timed_out, out
    assert res.backend == backend.name
    # The allowed counterpart: work/ took the write...
    assert "work=ok" in out and (s.job_dir / "work" / "a.txt").read_text() == "changed\n"
    # ...and nothing else did, with no capability, no privilege gain, seccomp on, no network.
    for line in ("root=ro", "input=ro", "task=ro", "ifaces: lo"):
        assert line in out, out
    assert re.search(r"CapEff:\s+0+\n", out) and re.search(r"NoNewPrivs:\s+1\n", out), out
    assert re.search(r"Seccomp:\s+2\n", out), out
    want_uid = 65534 if os.getuid() == 0 else os.getuid()  # never root inside
    assert f"uid={want_uid}\n" in out
    assert (s.job_dir / "input" / "a.txt").read_text() == "pristine\n"
    assert backend.find(job_id=s.job_id) == []  # removed after the run


def test_the_host_timeout_stops_the_container_and_removes_it(
    backend: Backend, shell: ImageRef, tmp_path: Path
) -> None:
    quick = spec(tmp_path, "echo done", waiving(backend), timeout_ms=20_000)
    assert backend.run(quick).timed_out is False  # the counterpart: a short job is not cut
    s = spec(tmp_path, "echo started; sleep 60", waiving(backend), timeout_ms=1500)
    t = time.monotonic()
    res = backend.run(s)
    assert res.timed_out and res.exit_code != 0
    assert time.monotonic() - t < 30
    assert "started" in log(s)
    assert backend.find(job_id=s.job_id) == []

    # A silent engine too: Podman answers a log stream only at the first output, and neither the
    # timeout nor the heartbeat may wait for it.
    beats: list[float] = []
    silent = spec(tmp_path, "sleep 60", waiving(backend), timeout_ms=2500)
    t = time.monotonic()
    res = backend.run(silent, heartbeat=lambda: beats.append(time.monotonic() - t), heartbeat_s=0.5)
    assert res.timed_out and time.monotonic() - t < 30
    assert len(beats) >= 2 and beats[0] < 2.0, beats
    assert backend.find(job_id=silent.job_id) == []


def test_a_heartbeat_that_asks_to_stop_ends_the_run_and_keeps_its_result(
    backend: Backend, shell: ImageRef, tmp_path: Path
) -> None:
    # How a waiting fallback cuts an attempt short (run/quota_watch.py): StopRun from the heartbeat.
    beats: list[float] = []

    def beat() -> None:
        beats.append(time.monotonic())
        if len(beats) >= 3:
            raise StopRun("enough")

    script = "echo started; echo kept > /job/work/a.txt; sleep 60"
    s = spec(tmp_path, script, waiving(backend), timeout_ms=50_000)
    t = time.monotonic()
    res = backend.run(s, heartbeat=beat, heartbeat_s=0.5)
    assert res.stopped == "enough" and not res.timed_out and res.exit_code != 0
    assert len(beats) == 3 and time.monotonic() - t < 30 and res.duration_s < 30
    # What it did and said before the stop is kept: the output, the log, work/.
    assert b"started" in res.output.stdout and "started" in log(s)
    assert (s.job_dir / "work" / "a.txt").read_text() == "kept\n"
    assert backend.find(job_id=s.job_id) == []
    # The counterpart: a heartbeat that asks nothing leaves the run to end by itself.
    quick = spec(tmp_path, "sleep 1; echo done", waiving(backend))
    res = backend.run(quick, heartbeat=lambda: None, heartbeat_s=0.2)
    assert res.stopped is None and res.exit_code == 0 and not res.timed_out


def test_ulimits_hold_inside_the_container(backend: Backend, shell: ImageRef, tmp_path: Path) -> None:
    needs_a_container(backend)
    p = waiving(backend, nofile=512, fsize="2m")
    script = (
        'echo "nofile=$(ulimit -n)"; '
        'dd if=/dev/zero of=/job/work/small bs=1024 count=1024 2>/dev/null && echo "small=ok"; '
        'dd if=/dev/zero of=/job/work/big bs=1024 count=4096 2>/dev/null || echo "big=refused"'
    )
    s = spec(tmp_path, script, p)
    backend.run(s)
    out = log(s)
    assert "nofile=512\n" in out, out
    assert "small=ok" in out and "big=refused" in out, out  # the allowed write first


def test_limits_are_enforced_or_the_policy_is_refused_before_any_container_unless_waived(
    backend: Backend, shell: ImageRef, tmp_path: Path
) -> None:
    needs_a_container(backend)
    p = policy(memory="64m", pids=64, cpus=0.5)
    missing = backend.unenforceable(p)
    if not missing:
        # Enforced: the container's own cgroup says so (measured, not assumed; v1, else v2).
        script = (
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max; "
            "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max; "
            "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us 2>/dev/null "
            "|| cat /sys/fs/cgroup/cpu.max"
        )
        s = spec(tmp_path, script, p)
        res = backend.run(s)
        assert res.waived == []
        assert log(s).split() == [str(64 << 20), "64", "50000", "100000"], log(s)
        return
    refused = spec(tmp_path, "echo ran > /job/work/ran", p)
    with pytest.raises(InvalidPolicy) as e:
        backend.run(refused)
    for w in missing:
        assert w in str(e.value)
    assert "waive" in (e.value.hint or "")
    assert not (refused.job_dir / "work" / "ran").exists() and backend.find(job_id=refused.job_id) == []
    # The waiver runs the same job, and says what it left unenforced.
    ok = spec(tmp_path, "echo ran > /job/work/ran", policy(memory="64m", pids=64, cpus=0.5, waive=missing))
    res = backend.run(ok)
    assert res.exit_code == 0 and res.waived == missing
    assert (ok.job_dir / "work" / "ran").read_text() == "ran\n"


def test_the_sweep_finds_fila_containers_by_label_and_removes_them(
    backend: Backend, shell: ImageRef, tmp_path: Path
) -> None:
    s = spec(tmp_path, "sleep 50", waiving(backend), timeout_ms=55_000)
    started = threading.Event()
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(backend.run(s, before_start=lambda _cid: started.set()))
        except BaseException as e:  # the container is removed under it: an error is expected
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    deadline = time.monotonic() + 20
    boxes = backend.find(root=str(tmp_path))
    while not boxes and time.monotonic() < deadline:
        time.sleep(0.2)
        boxes = backend.find(root=str(tmp_path))
    assert [b.labels.get(JOB_LABEL) for b in boxes] == [s.job_id]
    assert backend.find(root=str(tmp_path / "elsewhere")) == []  # another root's sweep misses it
    assert backend.remove(boxes[0]) is True
    t.join(60)
    assert not t.is_alive()
    assert backend.find(job_id=s.job_id) == []
    assert backend.remove(boxes[0]) is False  # gone already: not an error
    assert outcome and (isinstance(outcome[0], InfraError) or getattr(outcome[0], "exit_code", 0) != 0)


def test_image_lookup_and_build(backend: Backend, shell: ImageRef) -> None:
    assert backend.image(SHELL) == shell
    assert backend.image("fila/no-such-image:latest") is None
    assert SHELL in backend.tags(shell.id or "")
    assert backend.tags("fila/no-such-image:latest") == []
    again: list[str] = []
    assert backend.build("shell", progress=again.append) == shell  # current: reused, not rebuilt
    assert any("up to date" in line for line in again)


def test_an_engine_that_does_not_answer_is_a_clear_error_before_any_container(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.ping()  # the counterpart: the real one answers
    dead = tmp_path / "dead.sock"
    if isinstance(backend, FakeBackend):
        down: Backend = FakeBackend(backend.state, down="told to be down")
    elif backend.name == "podman":
        from fila.sandbox.podman.backend import PodmanBackend

        down = PodmanBackend(dead, autostart=False)
    else:
        from fila.sandbox.docker.backend import DockerBackend

        monkeypatch.setenv("DOCKER_HOST", f"unix://{dead}")
        down = DockerBackend()
    with pytest.raises(EngineUnavailable) as e:
        down.ping()
    assert e.value.hint and (backend.name != "podman" or str(dead) in str(e.value))
    s = spec(tmp_path, "echo ran > /job/work/ran", policy(waive=["memory", "pids", "cpus"]))
    with pytest.raises(EngineUnavailable):
        down.run(s)
    assert not (s.job_dir / "work" / "ran").exists()
