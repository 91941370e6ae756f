"""The benchmark harness works (bench/, docs/benchmarks.md): its cheapest case runs end to end,
and the floor's `docker run` carries every option of fila's container. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.floor import FloorSpec, docker_run_args, new_job
from bench.harness import table
from bench.queue_rate import measure

from tests.support.project import make_root


def test_queue_case_runs_and_prints(tmp_path: Path) -> None:
    rows = measure(tmp_path, n=5, reps=1)
    assert [r.case.split(" (")[0] for r in rows] == ["queue submit", "queue claim"]
    for r in rows:
        assert r.fila and r.fila > 0 and r.base and r.base > 0
        assert "fsyncs per" in r.note
    out = table(rows)
    assert "queue submit" in out and "tasks/s" in out
    assert list(tmp_path.iterdir()) == []  # its temp directories are removed


def test_floor_has_the_sandbox_options(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    job = new_job(tmp_path / "jobs", 0)
    argv = FloorSpec(root.path).docker_args(job, "fila-bench-test")
    joined = " ".join(argv)
    assert argv[:3] == ["docker", "run", "--rm"]
    for opt in (
        "--read-only",
        "--network none",
        "--cap-drop ALL",
        "--init",
        "--pids-limit",
        "--memory",
        "--cpus",
        "no-new-privileges",
        "--tmpfs /tmp:",
        "--ulimit nofile=",
        f"source={job.resolve()},target=/job",
        "target=/job/input,readonly",
    ):
        assert opt in joined, opt
    assert argv[argv.index("--entrypoint") + 2] == "fila/shell:latest"


def test_floor_refuses_an_option_it_cannot_translate() -> None:
    with pytest.raises(ValueError, match="not translated"):
        docker_run_args({"image": "x", "entrypoint": ["sh"], "command": [], "device_requests": []})


def test_the_cycle_case_runs_through_the_fake_backend_without_docker(tmp_path: Path) -> None:
    from bench.cycle_fake import measure as cycle_measure

    rows = cycle_measure(tmp_path, n=3, reps=1)
    assert [r.case.split(",")[0] for r in rows] == ["cycle via FakeBackend"] * 3 + [
        "verify one task's provenance (record"
    ]
    assert all(r.fila and r.fila > 0 and r.base is None for r in rows)
    assert list(tmp_path.iterdir()) == []
