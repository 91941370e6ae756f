"""The whole cycle on a real Docker engine, through the CLI: task in, container, diff, record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef
from fila.workspace import overlay
from tests.support.cli import fila
from tests.support.cli import submit_shell as submit
from tests.support.project import make_project, record

pytestmark = pytest.mark.docker

# The two workspace strategies a Docker job may run on: the copy (forced) and the default, which on
# this daemon is the overlay on a shared snapshot. A property the two implement differently is
# proven on both.
STRATEGIES = [
    pytest.param(({"FILA_WORKSPACE": "copy"}, "copy"), id="copy"),
    pytest.param(({}, "overlay"), id="overlay"),
]


def _input_of(proj: Path, rec: dict) -> Path:
    """The job's input/ as the host keeps it: the job copy, or the snapshot its overlay's lower is."""
    if rec["workspace"]["strategy"] == "overlay":
        ov = overlay.job_overlay(Root.at(proj), rec["id"])
        assert ov is not None
        return ov.lower
    return proj / "sandbox" / "jobs" / rec["id"] / "input"


def _work_of(proj: Path, rec: dict) -> Path:
    """What the engine wrote in work/ as the host reads it: the job copy, or its overlay's upper layer."""
    if rec["workspace"]["strategy"] == "overlay":
        ov = overlay.job_overlay(Root.at(proj), rec["id"])
        assert ov is not None
        return ov.upper
    return proj / "sandbox" / "jobs" / rec["id"] / "work"


@pytest.fixture
def proj(tmp_path: Path, shell_image: ImageRef) -> Path:
    files = {"src/run.sh": "#!/bin/sh\necho hello\n", ".env": "API_TOKEN=secret\n"}
    return make_project(tmp_path, files).path


def fila_containers(client: docker.DockerClient, root: Path) -> list:
    return client.containers.list(all=True, filters={"label": f"fila.root={root}"})


@pytest.mark.quick
def test_cycle_ends_in_needs_review_with_a_diff_that_git_applies(proj: Path) -> None:
    tid = submit(proj, "sed -i 's/hello/world/' greeting.txt")
    res = fila(proj, "run", "--once")
    assert res.exit_code == 0, res.output
    rec = record(proj, tid)
    assert rec["status"] == "needs_review"
    assert rec["exit_code"] == 0 and rec["image"]["id"].startswith("sha256:")
    assert rec["policy"]["name"] == "default" and len(rec["policy"]["sha256"]) == 64
    assert rec["diffstat"]["files"] == 1 and rec["diffstat"]["paths"] == ["greeting.txt"]
    assert {"prepare", "run", "diff", "total"} <= set(rec["timings"])
    patch = fila(proj, "diff", tid).stdout
    assert "-hello\n+world\n" in patch and "a/greeting.txt" in patch
    assert (proj / "greeting.txt").read_text() == "hello\n", "nothing touches the project"
    show = fila(proj, "show", tid)
    assert "needs_review" in show.stdout and "greeting.txt" in show.stdout
    # The patch applies in the project root.
    subprocess.run(["git", "apply", "--check", str(proj / rec["patch_path"])], cwd=proj, check=True)
    events = [
        json.loads(x)["event"]
        for x in (proj / "fila" / "logs" / f"{tid}.events.jsonl").read_text().splitlines()
    ]
    assert events[0] == "submitted" and "claimed" in events and events[-1] == "status"


def test_task_file_with_directory_target_and_json_output(proj: Path) -> None:
    task = {
        "id": "tf",
        "engine": "shell",
        "targets": ["src", "greeting.txt"],
        "command": "sed -i s/hello/bye/ src/run.sh && printf 'new\\n' > src/new.txt "
        "&& chmod +x src/new.txt && rm greeting.txt",
    }
    (proj / "task.json").write_text(json.dumps(task))
    assert fila(proj, "submit", str(proj / "task.json")).stdout.strip() == "tf"
    res = fila(proj, "run", "--once", "--json")
    assert res.exit_code == 0
    (line,) = res.stdout.splitlines()
    out = json.loads(line)
    assert out["id"] == "tf" and out["status"] == "needs_review"
    patch = (proj / out["patch_path"]).read_text()
    assert "new file mode 100755" in patch and "deleted file mode 100644" in patch
    assert ".env" not in patch


@pytest.mark.parametrize("workspace", STRATEGIES)
@pytest.mark.quick
def test_input_cannot_be_written_from_the_container(proj: Path, workspace: tuple[dict, str]) -> None:
    env, strategy = workspace
    tid = submit(proj, "echo pwned > ../input/greeting.txt")
    assert fila(proj, "run", "--once", env=env).exit_code == 1
    rec = record(proj, tid)
    assert rec["workspace"]["strategy"] == strategy, rec["workspace"]
    assert rec["status"] == "failed" and rec["error"]["kind"] == "engine_error"
    assert (_input_of(proj, rec) / "greeting.txt").read_text() == "hello\n"
    assert "Read-only file system" in (proj / rec["log_path"]).read_text()


def test_network_is_unreachable_under_the_default_policy(proj: Path) -> None:
    tid = submit(
        proj,
        "cat /proc/net/dev > net.txt; nc -w 2 198.51.100.1 80 </dev/null "
        "> out.txt 2>&1; echo rc=$? >> out.txt",
        "greeting.txt",
    )
    assert fila(proj, "run", "--once").exit_code == 0
    job = _work_of(proj, record(proj, tid))
    interfaces = [ln.split(":")[0].strip() for ln in (job / "net.txt").read_text().splitlines()[2:]]
    assert interfaces == ["lo"]
    assert "rc=0" not in (job / "out.txt").read_text()


def test_sleep_past_the_timeout_fails_with_timeout_and_keeps_the_partial_diff(
    proj: Path, docker_client: docker.DockerClient
) -> None:
    tid = submit(proj, "echo partial > progress.txt; sleep 30", extra=("--timeout", "1000"))
    res = fila(proj, "run", "--once")
    assert res.exit_code == 1
    rec = record(proj, tid)
    assert rec["status"] == "failed" and rec["error"]["kind"] == "timeout"
    assert "1 s" in rec["error"]["message"]
    assert "progress.txt" in (proj / rec["patch_path"]).read_text(), "partial diff kept as evidence"
    assert rec["timings"]["run"] < 15
    assert fila_containers(docker_client, proj) == [], "no container left behind"


def test_a_symlink_planted_in_work_does_not_make_the_host_read_outside(proj: Path) -> None:
    tid = submit(proj, "ln -s /etc/shadow shadow; ln -s /etc etc; ln -s ../../../../.. up")
    assert fila(proj, "run", "--once").exit_code == 0
    rec = record(proj, tid)
    patch = (proj / rec["patch_path"]).read_text()
    assert "new file mode 120000" in patch
    assert "+/etc/shadow" in patch and "root:" not in patch
    assert rec["diffstat"]["files"] == 3


def test_an_engine_replacing_work_with_a_symlink_fails_without_reading_it(proj: Path) -> None:
    tid = submit(proj, "cd .. && rm -rf work && ln -s /etc work")
    assert fila(proj, "run", "--once").exit_code == 1
    rec = record(proj, tid)
    assert rec["status"] == "failed"
    if rec["patch_path"]:  # as root, fila runs the engine as nobody, who cannot replace work/
        assert "root:" not in (proj / rec["patch_path"]).read_text()


@pytest.mark.parametrize("workspace", STRATEGIES)
def test_what_the_engine_leaves_is_made_inert_before_the_host_reads_it(
    proj: Path, workspace: tuple[dict, str]
) -> None:
    env, strategy = workspace
    tid = submit(
        proj,
        "cp /bin/busybox tool && chmod 6755 tool && mkdir -p sub/.git "
        "&& echo '[core] fsmonitor = touch /pwned' > sub/.git/config "
        "&& chmod 0777 . ; (echo x > ../planted) 2>/dev/null; true",
    )
    assert fila(proj, "run", "--once", env=env).exit_code == 0
    rec = record(proj, tid)
    assert rec["workspace"]["strategy"] == strategy, rec["workspace"]
    work = _work_of(proj, rec)
    st = os.stat(work / "tool")
    assert not st.st_mode & 0o7000, "setuid/setgid stripped on the host"
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert not os.stat(work).st_mode & 0o022, "no group/other write left"
    assert not (work / "sub" / ".git").exists()
    assert not (proj / "sandbox" / "jobs" / tid / "planted").exists()
    assert not (work.parent / "planted").exists()
    assert any("setuid" in w for w in rec["warnings"])
    assert any(".git" in w for w in rec["warnings"])
    assert os.stat(proj / "sandbox" / "jobs").st_mode & 0o077 == 0


def test_an_invalid_task_file_is_kept_with_its_reason_and_exits_2(proj: Path) -> None:
    (proj / "fila" / "in" / "broken.json").write_text('{"engine": "shell", "targets": [')
    res = fila(proj, "run", "--once")
    assert res.exit_code == 2
    assert not (proj / "fila" / "in" / "broken.json").exists()
    kept = proj / "fila" / "rejected" / "broken.json"
    assert kept.read_text() == '{"engine": "shell", "targets": ['
    assert "malformed JSON" in (proj / "fila" / "rejected" / "broken.json.reason").read_text()
    rec = record(proj, "broken")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid"


def test_a_task_dropped_into_fila_in_runs(proj: Path) -> None:
    task = {"engine": "shell", "command": "echo dropped >> greeting.txt", "targets": ["greeting.txt"]}
    (proj / "fila" / "in" / "dropped.json").write_text(json.dumps(task))
    assert fila(proj, "run", "--once").exit_code == 0
    assert record(proj, "dropped")["status"] == "needs_review"


def test_unreachable_docker_keeps_the_task_queued_and_exits_3(proj: Path) -> None:
    tid = submit(proj, "true")
    res = fila(proj, "run", "--once", env={"DOCKER_HOST": f"unix://{proj}/no.sock"})
    assert res.exit_code == 3
    assert "Docker" in res.stderr
    assert record(proj, tid)["status"] == "queued"
    assert (proj / "fila" / "in" / f"{tid}.json").exists()


def test_a_pinned_image_that_is_not_built_fails_its_task_with_a_build_hint(proj: Path) -> None:
    task = {
        "id": "noimg",
        "engine": "shell",
        "command": "true",
        "targets": ["greeting.txt"],
        "image": "fila/not-built-anywhere:latest",
    }
    (proj / "t.json").write_text(json.dumps(task))
    assert fila(proj, "submit", str(proj / "t.json")).exit_code == 0
    res = fila(proj, "run", "--once")
    # A pinned image no retry can make appear is the task's own failure: recorded,
    # not requeued, and the run is not stopped (exit 2: a task was invalid, Docker is fine).
    assert res.exit_code == 2, res.output
    rec = record(proj, "noimg")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec
    assert "fila/not-built-anywhere:latest" in rec["error"]["message"]
    assert "fila images build shell" in rec["error"]["message"]
    assert not (proj / "fila" / "in" / "noimg.json").exists()


@pytest.mark.parametrize("workspace", STRATEGIES)
def test_work_stays_owned_by_the_host_user(proj: Path, workspace: tuple[dict, str]) -> None:
    env, strategy = workspace
    tid = submit(proj, "echo x > created.txt")
    assert fila(proj, "run", "--once", env=env).exit_code == 0
    rec = record(proj, tid)
    assert rec["workspace"]["strategy"] == strategy, rec["workspace"]
    st = os.stat(_work_of(proj, rec) / "created.txt")
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


def test_diff_refuses_a_patch_changed_after_the_record(proj: Path) -> None:
    tid = submit(proj, "sed -i 's/hello/world/' greeting.txt")
    assert fila(proj, "run", "--once").exit_code == 0
    patch = proj / record(proj, tid)["patch_path"]
    patch.write_text(patch.read_text().replace("+world", "+w0rld"))
    res = fila(proj, "diff", tid)
    assert res.exit_code == 4 and "sha256" in res.stderr


def test_logs_print_the_engine_output_and_the_events(proj: Path) -> None:
    tid = submit(proj, "echo progress-line; printf 'esc\\033[2Jhere\\n'")
    assert fila(proj, "run", "--once").exit_code == 0
    out = fila(proj, "logs", tid)
    assert out.exit_code == 0 and "progress-line" in out.stdout
    ev = fila(proj, "logs", tid, "--events", "--follow")
    assert ev.exit_code == 0
    assert next(json.loads(x)["event"] for x in ev.stdout.splitlines()) == "submitted"
    assert fila(proj, "logs", "nope").exit_code == 5
