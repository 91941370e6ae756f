"""The CI path: `fila submit ... --run`, one process from nothing to a reviewed diff,
keeps every guarantee of `submit` + `run --once` (the claim by rename, durable records, recovery
of what a crash left, the breaker), and both forms say where the time went (`timings`).

Real CLI processes on the real Docker daemon. No timing thresholds: only that the phases are
there and add up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import Status
from fila.queue import breaker
from fila.queue import store as queue
from tests.support.cli import CLI, submit_process
from tests.support.cli import fila_process as fila
from tests.support.containers import Starts, containers_left
from tests.support.crash import EXPECTED, assert_one_state_each
from tests.support.marks import matrix_beyond

S = Status
pytestmark = pytest.mark.docker

# The phases of run_one, contiguous: they add up to `total`.
LAPS = ("begin", "validate", "prepare", "run", "diff")
# The backend's run, split: they add up to `run`.
CONTAINER = ("create", "start_wait", "remove")


def records_of(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def assert_breakdown(t: dict[str, float], *, process: bool) -> None:
    """Every phase present, none negative, the laps adding up to `total` and the container's
    phases to `run` (each rounded to the millisecond)."""
    for k in (*LAPS, *CONTAINER, "total", "record", *(("startup", "claim") if process else ())):
        assert k in t and t[k] >= 0, (k, t)
    assert abs(sum(t[k] for k in LAPS) - t["total"]) <= 0.001 * (len(LAPS) + 1), t
    assert abs(sum(t[k] for k in CONTAINER) - t["run"]) <= 0.001 * (len(CONTAINER) + 1), t
    assert t["start_wait"] > 0, "the container ran"


def test_submit_run_takes_its_task_to_review_in_one_process_and_leaves_the_others(proj: Root) -> None:
    submit_process(proj, "other", "echo other >> greeting.txt", check=True)
    res = submit_process(proj, "mine", "sed -i s/hello/world/ greeting.txt", "--run", "--json")
    assert res.returncode == 0, res.stderr
    (rec,) = records_of(res.stdout)
    assert rec["id"] == "mine" and rec["status"] == "needs_review"
    assert rec["diffstat"]["files"] == 1
    assert_breakdown(rec["timings"], process=True)
    # The record on disk has every phase but its own write, which only the printed copy can hold.
    disk = queue.get_record(proj, "mine").timings
    assert disk == {k: v for k, v in rec["timings"].items() if k != "record"}
    # Another queued task is left to the workers, and a worker takes it as before.
    assert queue.get_record(proj, "other").status == S.queued and proj.queued_path("other").exists()
    res = fila(proj, "run", "--once", "--json")
    assert res.returncode == 0, res.stderr
    (rec,) = records_of(res.stdout)
    assert rec["id"] == "other" and rec["status"] == "needs_review"
    assert_breakdown(rec["timings"], process=True)


def test_submit_run_without_json_prints_the_summary_and_exit_code_of_run_once(proj: Root) -> None:
    ok = submit_process(proj, "good", "true", "--run", "--quiet")
    assert ok.returncode == 0 and ok.stdout.startswith("good  needs_review"), ok.stdout + ok.stderr
    bad = submit_process(proj, "bad", "exit 3", "--run", "--quiet")
    assert bad.returncode == 1 and bad.stdout.startswith("bad  failed"), bad.stdout + bad.stderr
    shown = fila(proj, "show", "good", check=True).stdout
    assert "start_wait" in shown and "startup" in shown


# The points between claim and record are run --once's too (tests/test_durability.py kills it at
# each on Docker): the default run kills submit --run at its first and last; --all at every one.
@pytest.mark.parametrize(
    "point",
    matrix_beyond(["after_claim", "after_begin", "after_checkpoint", "after_diff", "after_record"],
                  "after_claim", "after_record"),
)  # fmt: skip
def test_submit_run_killed_at_a_crash_point_is_recovered_like_run_once(
    proj: Root, docker_client: docker.DockerClient, started_containers: Starts, point: str
) -> None:
    crashed = submit_process(proj, "t1", "echo world >> greeting.txt", "--run", crash=point)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    rep = json.loads(fila(proj, "recover", "--json", check=True).stdout)
    assert rep["docker"] == "ok"
    assert containers_left(docker_client, proj) == []
    assert assert_one_state_each(proj, ["t1"]) == {"t1": EXPECTED[point]}
    ran = started_containers.count()
    fila(proj, "run", "--once")
    after = queue.get_record(proj, "t1")
    if EXPECTED[point] == S.queued:
        assert after.status == S.needs_review
        assert started_containers.count() == 1, "exactly one run in total"
    else:
        assert after.status == EXPECTED[point], "a started task is never rerun without a person"
        assert started_containers.count() == ran <= 1


def test_submit_run_stops_at_an_open_breaker_and_leaves_the_task_queued(proj: Root) -> None:
    pol = json.loads((proj.policies_dir / "default.json").read_text())
    # A failure the author did not choose (the policy's own timeout on a command that hangs).
    pol["max_consecutive_failures"], pol["default_timeout_ms"] = 1, 1000
    (proj.policies_dir / "strict.json").write_text(json.dumps(pol))
    ok = submit_process(proj, "ok", "true", "--policy", "strict", "--run")
    assert ok.returncode == 0, ok.stderr
    hung = submit_process(proj, "hung", "trap 'exit 0' TERM; sleep 30 & wait", "--policy", "strict", "--run")
    assert hung.returncode == 6 and queue.get_record(proj, "hung").status == S.failed, hung.stderr
    assert breaker.read(proj).open
    res = submit_process(proj, "next", "true", "--policy", "strict", "--run")
    assert res.returncode == 6 and "circuit breaker" in res.stderr
    assert queue.get_record(proj, "next").status == S.queued and proj.queued_path("next").exists()
    fila(proj, "rearm", "--by", "ana", "--reason", "fixed", check=True)
    assert fila(proj, "run", "--once").returncode == 0
    assert queue.get_record(proj, "next").status == S.needs_review


def test_submit_run_racing_a_worker_for_its_task_runs_it_once_and_reports_it(
    proj: Root, started_containers: Starts
) -> None:
    env = {**os.environ, "FILA_ROOT": str(proj.path)}
    env.pop("FILA_CRASH_AT", None)
    worker = subprocess.Popen(
        [*CLI, "worker"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # The worker watches fila/in/ (inotify) before the task appears: both race for the rename.
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(worker.stderr.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        assert first and "watching" in first[0], first
        worker_id = first[0].split()[2].rstrip(":")
        res = submit_process(proj, "raced", "echo raced >> greeting.txt", "--run", "--json")
    finally:
        worker.send_signal(signal.SIGTERM)
        w_out, _ = worker.communicate(timeout=120)
    assert res.returncode == 0, res.stderr
    (rec,) = records_of(res.stdout)
    assert rec["id"] == "raced" and rec["status"] == "needs_review"
    final = queue.get_record(proj, "raced")
    assert final.attempt == 1 and final.status == S.needs_review
    assert started_containers.count() == 1, "one claim, one run"
    # Whichever process won the rename ran it; the other ran nothing and (submit --run) printed
    # the winner's record.
    assert ("raced" in w_out) == (final.worker == worker_id), (w_out, final.worker, worker_id)
    assert rec["worker"] == final.worker


def test_submit_run_without_docker_keeps_the_task_queued_for_a_later_run(proj: Root, tmp_path: Path) -> None:
    res = submit_process(
        proj, "later", "true", "--run", env_extra={"DOCKER_HOST": f"unix://{tmp_path}/no-such.sock"}
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert queue.get_record(proj, "later").status == S.queued and proj.queued_path("later").exists()
    res = fila(proj, "run", "--once")
    assert res.returncode == 0, res.stderr
    assert queue.get_record(proj, "later").status == S.needs_review
