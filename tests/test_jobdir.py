"""Preparing the job directory from the project (no Docker)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from fila.core.errors import TargetError
from fila.core.layout import Root
from fila.queue.policy import load_policy, narrow
from fila.workspace import jobdir
from tests.support.project import make_project, shell_task


@pytest.fixture
def root(tmp_path: Path) -> Root:
    r = make_project(tmp_path).require()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print('hello')\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / ".env").write_text("SECRET=1\n")
    (src / "key.pem").write_text("-----BEGIN\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref\n")
    os.symlink("a.py", src / "inner-link")
    os.symlink("/etc/passwd", src / "abs-link")
    os.mkfifo(src / "pipe")
    return r


def prepare(root: Root, targets: list[str]) -> jobdir.Prepared:
    task = shell_task(targets=targets)
    policy, _ = load_policy(root, "default")
    return jobdir.prepare(root, "job1", task, policy, narrow(policy, task))


def test_targets_are_copied_into_input_and_work(root: Root) -> None:
    prep = prepare(root, ["greeting.txt", "src"])
    for side in ("input", "work"):
        base = prep.job_dir / side
        assert (base / "greeting.txt").read_text() == "hello\n"
        assert (base / "src" / "a.py").read_text() == "print('hello')\n"
        assert os.stat(base / "src" / "run.sh").st_mode & 0o777 == 0o755
        assert os.stat(base / "src" / "a.py").st_mode & 0o777 == 0o644
    assert not os.path.samefile(
        prep.job_dir / "input" / "greeting.txt", prep.job_dir / "work" / "greeting.txt"
    )


def test_secrets_and_vcs_metadata_are_never_copied(root: Root) -> None:
    prep = prepare(root, ["src"])
    names = {p.name for p in (prep.job_dir / "work" / "src").iterdir()}
    assert ".env" not in names and "key.pem" not in names and ".git" not in names
    assert "pipe" not in names
    assert any("pipe" in w for w in prep.warnings)


def test_symlinks_are_copied_as_links_never_followed(root: Root) -> None:
    prep = prepare(root, ["src"])
    work = prep.job_dir / "work" / "src"
    assert os.readlink(work / "inner-link") == "a.py"
    assert os.readlink(work / "abs-link") == "/etc/passwd"
    entry = next(m for m in prep.manifest if m.path == "src/abs-link")
    assert entry.kind == "symlink"


def test_manifest_records_what_was_copied_host_side(root: Root) -> None:
    prep = prepare(root, ["greeting.txt"])
    m = jobdir.read_manifest(root, "job1")
    (entry,) = m["entries"]
    assert entry["path"] == "greeting.txt"
    assert entry["sha256"] == hashlib.sha256(b"hello\n").hexdigest()
    assert entry["size"] == 6 and entry["mode"] == 0o644
    assert not (prep.job_dir / "manifest.json").exists(), "the engine must not reach the manifest"


def test_task_md_holds_prompt_targets_and_limits(root: Root) -> None:
    prep = prepare(root, ["greeting.txt"])
    text = (prep.job_dir / "TASK.md").read_text()
    assert "greeting.txt" in text and "timeout" in text and "network none" in text


def test_whole_project_target_skips_the_queue_itself(root: Root) -> None:
    (root.in_dir / "x.json").write_text("{}")
    prep = prepare(root, ["."])
    work = prep.job_dir / "work"
    assert (work / "greeting.txt").exists()
    assert not (work / "fila").exists() and not (work / "sandbox").exists()


def test_symlinked_directory_on_the_way_is_refused(root: Root) -> None:
    os.symlink("src", root.path / "srclink")
    with pytest.raises(TargetError, match="goes through the symlink"):
        prepare(root, ["srclink/a.py"])


def test_a_requeued_task_starts_from_a_clean_copy(root: Root) -> None:
    prep = prepare(root, ["greeting.txt"])
    (prep.job_dir / "work" / "greeting.txt").write_text("changed by a first attempt\n")
    (prep.job_dir / "work" / "junk").write_text("x")
    prep = prepare(root, ["greeting.txt"])
    assert (prep.job_dir / "work" / "greeting.txt").read_text() == "hello\n"
    assert not (prep.job_dir / "work" / "junk").exists()


def test_both_strategies_give_a_backend_the_job_read_only_and_only_work_writable(tmp_path: Path) -> None:
    """The Workspace seam (core/mounts.py) as a backend reads it: the copy binds the job's own
    input/ and work/; the overlay binds the snapshot as input/ and makes work/ an overlay whose
    writes land in the job's upper layer, counted by `usage` with the job directory."""
    from fila.core.mounts import Bind, OverlayVolume, Workspace, overlay_of
    from fila.workspace.overlay import Overlay
    from fila.workspace.strategy import CopyWorkspace, OverlayWorkspace

    job = tmp_path / "job"
    for d in ("input", "work"):
        (job / d).mkdir(parents=True)
    copy = CopyWorkspace(job)
    assert isinstance(copy, Workspace) and copy.layers() is None and overlay_of(copy, "/job") is None
    assert copy.mounts("/job") == [
        Bind("/job", job.resolve(), read_only=True),
        Bind("/job/input", job.resolve() / "input", read_only=True),
        Bind("/job/work", job.resolve() / "work", read_only=False),
    ]
    lower, upper, scratch = tmp_path / "snap", tmp_path / "ov" / "upper", tmp_path / "ov" / "work"
    for d in (lower, upper, scratch):
        d.mkdir(parents=True)
    (upper / "new.txt").write_bytes(b"x" * 10_000)
    over = OverlayWorkspace(job, Overlay(lower, upper, scratch, 0, 0))
    assert isinstance(over, Workspace)
    volume = OverlayVolume("/job/work", lower, upper, scratch)
    assert over.mounts("/job")[1:] == [Bind("/job/input", lower, read_only=True), volume]
    assert overlay_of(over, "/job") == volume
    assert volume.options() == f"lowerdir={lower},upperdir={upper},workdir={scratch},userxattr"
    used, files = over.usage(max_bytes=1 << 30, max_files=1000)
    assert (used, files) > copy.usage(max_bytes=1 << 30, max_files=1000) and used >= 10_000
