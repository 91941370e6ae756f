"""The fake backend (sandbox/fake.py): chosen only explicitly, runs the cycle without containers,
fails and stalls when told to, and leaves boxes another process's recovery finds and removes.

The promises it shares with the container backends are in tests/test_backend_contract.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fila.core.errors import EngineUnavailable, InfraError, InvalidInput, InvalidPolicy
from fila.core.layout import Root
from fila.core.models import Policy, Status
from fila.queue import store as queue
from fila.run import job as cycle
from fila.sandbox import get_backend
from fila.sandbox.base import ROOT_LABEL, RunSpec
from fila.sandbox.fake import NOT_A_SANDBOX, Act, FakeBackend
from fila.workspace.strategy import CopyWorkspace
from tests.support.cli import fila, submit_shell
from tests.support.project import make_project, record

CLI = [sys.executable, "-c", "from fila.cli import main; main()"]


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return make_project(tmp_path / "proj")


@pytest.fixture
def fake(tmp_path: Path) -> FakeBackend:
    return FakeBackend(tmp_path / "boxes")


def run_task(root: Root, backend: FakeBackend, command: str = "true") -> dict:
    tid = submit_shell(root.path, command)
    claim = cycle.next_claim(root, "w1")
    assert claim is not None and claim.task_id == tid
    cycle.run_one(root, claim, backend=backend)
    return record(root.path, tid)


def pol(**kw: object) -> Policy:
    base: dict[str, object] = dict(max_timeout_ms=60_000, default_timeout_ms=10_000, grace_ms=200)
    return Policy.model_validate(base | kw)


def spec(tmp_path: Path, policy: Policy | None = None, **kw: object) -> RunSpec:
    job_dir = tmp_path / "jobs" / "j1"
    (job_dir / "input").mkdir(parents=True, exist_ok=True)
    (job_dir / "work").mkdir(exist_ok=True)
    fields: dict = dict(
        job_id="j1",
        workspace=CopyWorkspace(job_dir),
        image="fila/shell:latest",
        argv=["/bin/sh", "-c", "true"],
        env={},
        policy=policy or pol(),
        limits=None,
        timeout_ms=10_000,
        log_path=tmp_path / "logs" / "j1.log",
        labels={ROOT_LABEL: str(tmp_path)},
    )
    return RunSpec(**(fields | kw))


def test_the_fake_is_chosen_by_fila_backend_only_never_by_a_queue_roots_config(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FILA_BACKEND", "fake")
    assert isinstance(get_backend(), FakeBackend)
    monkeypatch.delenv("FILA_BACKEND")
    with pytest.raises(InvalidInput, match="not a sandbox"):
        get_backend("fake")  # what a root's fila/config.json naming it would choose
    res = fila(root.path, "init", "--backend", "fake")
    assert res.exit_code == 2 and "not a sandbox" in res.output
    assert (
        "fake" not in (root.fila / "config.json").read_text()
        if (root.fila / "config.json").exists()
        else True
    )


def test_a_shell_task_runs_its_command_in_work_and_reaches_review_with_its_diff(
    root: Root, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FILA_HOST_ONLY", "leaked")
    cmd = (
        'echo changed > greeting.txt; echo "pwd=$(pwd)"; echo "host=${FILA_HOST_ONLY:-unset}"; echo oops >&2'
    )
    rec = run_task(root, fake, cmd)
    assert rec["status"] == "needs_review", rec
    assert rec["backend"] == "fake" and NOT_A_SANDBOX in rec["warnings"]
    log = (root.fila / "logs" / f"{rec['id']}.log").read_text()
    assert "/work\n" in log and "host=unset" in log and "oops" in log, log  # spec.env only
    patch = (root.path / rec["patch_path"]).read_text() if not Path(rec["patch_path"]).is_absolute() else ""
    patch = patch or Path(rec["patch_path"]).read_text()
    assert "+changed" in patch and "-hello" in patch
    assert (root.path / "greeting.txt").read_text() == "hello\n", "nothing lands before a person applies"
    assert fake.find(root=str(root.path)) == []


def test_a_failing_command_is_an_engine_error_with_its_exit_code(root: Root, fake: FakeBackend) -> None:
    rec = run_task(root, fake, "exit 3")
    assert rec["status"] == "failed" and "code 3" in rec["error"]["message"], rec


def test_a_script_gives_the_exit_output_and_files_without_running_the_command(tmp_path: Path) -> None:
    act = Act(exit_code=4, stdout="out\n", stderr="err\n", seconds=0.2, files={"new.txt": "x"})
    b = FakeBackend(tmp_path / "boxes", script={"j1": act})
    s = spec(tmp_path, argv=["/bin/sh", "-c", "touch ran"])
    t = time.monotonic()
    res = b.run(s)
    assert res.exit_code == 4 and not res.timed_out and time.monotonic() - t >= 0.2
    assert res.output.stdout == b"out\n" and res.output.stderr == b"err\n"
    assert (s.job_dir / "work" / "new.txt").read_text() == "x" and not (s.job_dir / "work" / "ran").exists()
    assert NOT_A_SANDBOX not in res.warnings, "a script runs nothing on the host"
    assert b.specs == [s]


def test_a_stalled_job_ends_only_at_the_host_timeout_with_heartbeats_meanwhile(tmp_path: Path) -> None:
    b = FakeBackend(tmp_path / "boxes", script=lambda _s: Act(stall=True, stdout="started\n"))
    beats: list[float] = []
    res = b.run(spec(tmp_path, timeout_ms=800), heartbeat=lambda: beats.append(1), heartbeat_s=0.2)
    assert res.timed_out and res.exit_code == 128 + signal.SIGTERM
    assert len(beats) >= 2 and b.find() == []


def test_the_command_is_stopped_by_sigterm_then_sigkill_after_the_grace(tmp_path: Path) -> None:
    b = FakeBackend(tmp_path / "boxes")
    s = spec(tmp_path, argv=["/bin/sh", "-c", "trap '' TERM; echo started; sleep 30"], timeout_ms=500)
    res = b.run(s)
    assert res.timed_out and res.exit_code == 128 + signal.SIGKILL, "SIGTERM was ignored: SIGKILL"
    assert "started" in s.log_path.read_text()


def test_a_log_is_redacted_and_capped_like_a_containers(tmp_path: Path) -> None:
    b = FakeBackend(tmp_path / "boxes")
    p = pol(max_log_bytes=1 << 20)
    argv = ["/bin/sh", "-c", "echo key=s3cr3t-value-123; head -c 3000000 /dev/zero"]
    s = spec(tmp_path, p, argv=argv, redact=["s3cr3t-value-123"])
    res = b.run(s)
    log = s.log_path.read_bytes()
    assert b"s3cr3t" not in log and b"key=***" in log
    assert res.log_truncated and res.exit_code == 0 and b"log truncated" in log


def test_an_engine_that_is_down_or_refuses_allowlist_starts_nothing(tmp_path: Path) -> None:
    b = FakeBackend(tmp_path / "boxes", down="daemon gone")
    with pytest.raises(EngineUnavailable, match="fake backend does not answer"):
        b.ping()
    with pytest.raises(EngineUnavailable):
        b.run(spec(tmp_path, argv=["/bin/sh", "-c", "touch ran"]))
    b.down = None
    allow = pol(network="allowlist", egress={"allow": [{"host": "example.com"}]})
    with pytest.raises(InvalidPolicy, match="fake backend does not run network allowlist"):
        b.run(spec(tmp_path, allow, argv=["/bin/sh", "-c", "touch ran"]))
    assert not (tmp_path / "jobs" / "j1" / "work" / "ran").exists() and b.find() == []


def test_limits_it_is_told_it_cannot_enforce_are_refused_unless_waived(tmp_path: Path) -> None:
    b = FakeBackend(tmp_path / "boxes", unenforceable=["memory"])
    with pytest.raises(InvalidPolicy, match="fake backend cannot enforce the policy's memory"):
        b.run(spec(tmp_path))
    assert b.run(spec(tmp_path, pol(waive=["memory"]))).waived == ["memory"]


@pytest.mark.parametrize("at", ["create", "start"])
def test_an_infra_error_before_or_after_the_start_decides_requeue_or_needs_human(
    root: Root, tmp_path: Path, at: str
) -> None:
    b = FakeBackend(tmp_path / "boxes", script=lambda _s: Act(error=InfraError("injected"), error_at=at))
    tid = submit_shell(root.path, "true")
    claim = cycle.next_claim(root, "w1")
    assert claim is not None
    if at == "create":
        with pytest.raises(InfraError):
            cycle.run_one(root, claim, backend=b)
        assert queue.get_record(root, tid).status == Status.queued, "never started: handed back"
    else:
        cycle.run_one(root, claim, backend=b)
        assert queue.get_record(root, tid).status == Status.needs_human, "it started: a person decides"
    assert b.find() == []


def test_a_box_whose_removal_fails_stays_for_another_process_to_find_and_remove(
    root: Root, tmp_path: Path
) -> None:
    b = FakeBackend(tmp_path / "boxes", script=lambda _s: Act(error=InfraError("stuck"), error_at="remove"))
    s = spec(tmp_path)
    with pytest.raises(InfraError, match="stuck"):
        b.run(s)
    other = FakeBackend(tmp_path / "boxes")  # another process naming the same state directory
    [box] = other.find(job_id="j1")
    assert box.status == "exited" and box.exit_code == 0
    assert other.remove(box) is True and other.remove(box) is False and b.find() == []


def test_recover_in_another_process_kills_the_command_a_killed_worker_left_running(
    root: Root, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "FILA_ROOT": str(root.path),
        "FILA_BACKEND": "fake",
        "FILA_FAKE_DIR": str(tmp_path / "boxes"),
    }
    env.pop("FILA_CRASH_AT", None)
    pidfile = tmp_path / "engine.pid"
    tid = submit_shell(root.path, f"echo $$ > {pidfile}; exec sleep 120")
    worker = subprocess.Popen(
        [*CLI, "run", "--once"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline and worker.poll() is None, "the command never started"
            time.sleep(0.05)
        engine = int(pidfile.read_text())
    finally:
        worker.kill()  # the worker dies mid-run; its command (a session of its own) runs on
        worker.wait()
    os.kill(engine, 0)  # still running
    [box] = FakeBackend(tmp_path / "boxes").find(job_id=tid)
    assert box.status == "running"
    res = subprocess.run([*CLI, "recover", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["backend"] == "fake"
    rec = record(root.path, tid)
    assert rec["status"] == "needs_human" and "found and removed" in rec["diagnosis"], rec
    deadline = time.monotonic() + 10
    while Path(f"/proc/{engine}").exists() and _state(engine) != "Z":
        assert time.monotonic() < deadline, "the left command still runs"
        time.sleep(0.05)
    assert FakeBackend(tmp_path / "boxes").find() == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return "gone"
