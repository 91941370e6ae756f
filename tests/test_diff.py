"""diff.compute_diff: the patch `git apply` must turn input/ into work/, whatever work/ holds."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from fila.core.errors import FilaError, LimitExceeded
from fila.workspace.diff import DiffResult, compute_diff
from tests.support.policy import policy
from tests.support.spy import finishes, watch
from tests.support.trees import Node, build, put, tree_pairs


def new_job(base: Path) -> Path:
    job = base / "job"
    (job / "input").mkdir(parents=True)
    (job / "work").mkdir()
    return job


def snapshot(root: Path) -> dict[bytes, Node]:
    """Files and symlinks (content, exec bit, link text); directories do not matter to git."""
    out: dict[bytes, Node] = {}
    base = os.fsencode(root)
    for dirpath, dirs, files in os.walk(base):
        for name in dirs + files:
            path = dirpath + b"/" + name
            st_ = os.lstat(path)
            rel = os.path.relpath(path, base)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st_.st_mode):
                with open(path, "rb") as f:
                    out[rel] = ("file", f.read(), bool(st_.st_mode & stat.S_IXUSR))
    return out


def git_apply(patch: Path, target: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": os.environ["PATH"], "HOME": str(target.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CEILING_DIRECTORIES": str(target.parent)}  # fmt: skip
    return subprocess.run(["git", "apply", *extra, str(patch)], cwd=target, env=env,
                          capture_output=True, check=False)  # fmt: skip


def diff(job: Path, **kw: object) -> DiffResult:
    return compute_diff(job, policy=policy(**kw), scratch=job.parent / "scratch")


def assert_roundtrip(job: Path, result: DiffResult) -> None:
    """The contract apply relies on: input/ + the patch == work/ (bytes, exec bits, links)."""
    target = job.parent / "applied"
    shutil.copytree(job / "input", target, symlinks=True)
    if result.bytes:
        for extra in (("--check",), ()):
            res = git_apply(result.patch_path, target, *extra)
            assert res.returncode == 0, res.stderr.decode(errors="replace")
    assert snapshot(target) == snapshot(job / "work")


def sections(patch: bytes) -> dict[bytes, bytes]:
    parts = patch.split(b"\ndiff --git ")
    return {p.split(b"\n", 1)[0]: p for p in [parts[0].removeprefix(b"diff --git "), *parts[1:]]}


# --- the round-trip property ------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=tree_pairs())
def test_git_apply_of_the_patch_turns_input_into_work(tmp_path: Path, pair: tuple) -> None:
    job = new_job(Path(tempfile.mkdtemp(dir=tmp_path)))
    build(job / "input", pair[0])
    build(job / "work", pair[1])
    result = diff(job, deny=[])
    assert_roundtrip(job, result)
    assert (result.bytes == 0) == (snapshot(job / "input") == snapshot(job / "work"))
    assert result.sha256 == hashlib.sha256(result.patch_path.read_bytes()).hexdigest()


# --- the format -------------------------------------------------------------------------------


def test_unchanged_work_gives_an_empty_patch(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    for root in (job / "input", job / "work"):
        put(root, "a/b.txt", b"same\n")
        put(root, "run.sh", b"#!/bin/sh\n", mode=0o755)
        put(root, "ln", link="a/b.txt")
    os.chmod(job / "work" / "a" / "b.txt", 0o600)  # same exec bit: git sees no change
    result = diff(job)
    assert result.bytes == 0 and result.patch_path.read_bytes() == b""
    assert result.sha256 == hashlib.sha256(b"").hexdigest()
    assert result.stat.files == 0 and result.stat.paths == [] and result.warnings == []


def test_identical_sides_do_not_collide_in_the_shared_repository(tmp_path: Path) -> None:
    # Both fast-imports write packs into one repository; identical packs once collided.
    for i in range(10):
        job = new_job(tmp_path / str(i))
        put(job / "input", "tool", b"x\n")
        put(job / "work", "tool", b"x\n", mode=0o755 if i % 2 else 0o644)
        result = diff(job)
        assert result.stat.files == i % 2
        assert_roundtrip(job, result)


def test_text_binary_modes_links_and_the_stat(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "input", "t.txt", b"one\ntwo\nthree\n")
    put(job / "work", "t.txt", b"one\n2\nthree\nfour\n")
    put(job / "input", "img.bin", b"\0\1\2" * 100)
    put(job / "work", "img.bin", b"\0\1\3" * 100)
    put(job / "input", "gone.txt", b"bye\n")
    put(job / "work", "empty", b"")
    put(job / "input", "tool", b"x\n")
    put(job / "work", "tool", b"x\n", mode=0o755)
    put(job / "work", "name with spaces/ünï.txt", b"hi\n")
    put(job / "work", "ln", link="t.txt")
    result = diff(job)
    patch = result.patch_path.read_bytes()
    assert patch.startswith(b"diff --git a/")
    assert b"GIT binary patch" in patch
    assert b"old mode 100644\nnew mode 100755" in patch
    assert b"new file mode 120000" in patch and b"+t.txt\n\\ No newline at end of file" in patch
    assert b"new file mode 100644\nindex 0000000000000000000000000000000000000000..e69de29" in patch
    assert b"deleted file mode 100644" in patch
    assert result.stat.files == 7 and result.stat.binary == 1
    assert (result.stat.insertions, result.stat.deletions) == (2 + 1 + 1, 1 + 1)
    assert result.stat.paths == sorted(result.stat.paths, key=lambda p: p.encode())
    assert "name with spaces/ünï.txt" in result.stat.paths
    assert_roundtrip(job, result)
    assert diff(job).sha256 == result.sha256  # deterministic


def test_a_path_that_changes_between_file_directory_and_link_round_trips(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "input", "f2d", b"file\n")
    put(job / "work", "f2d/inside", b"now a dir\n")
    put(job / "input", "d2f/inside", b"dir\n")
    put(job / "work", "d2f", b"now a file\n")
    put(job / "input", "f2l", b"file\n")
    put(job / "work", "f2l", link="target")
    put(job / "input", "l2f", link="target")
    put(job / "work", "l2f", b"file\n")
    put(job / "input", "d2l/x", b"x\n")
    put(job / "work", "d2l", link="/etc")
    put(job / "input", "l2d", link="/etc")
    put(job / "work", "l2d/x", b"x\n")
    assert_roundtrip(job, diff(job))


def test_large_files_are_compared_and_streamed_in_chunks(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    big = os.urandom(3 << 20)
    for root in (job / "input", job / "work"):
        put(root, "same.bin", big)
    put(job / "input", "changed.bin", big)
    # The changed byte is the original one inverted, so it differs whatever the random data holds.
    flipped = bytes([big[2 << 20] ^ 0xFF])
    put(job / "work", "changed.bin", big[: 2 << 20] + flipped + big[(2 << 20) + 1 :])
    put(job / "work", "added.bin", big)
    result = diff(job)
    assert result.stat.paths == ["added.bin", "changed.bin"]
    assert_roundtrip(job, result)


# --- hostile work/ ----------------------------------------------------------------------------


def test_symlink_to_a_host_file_is_data(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-MARKER\n")
    job = new_job(tmp_path)
    put(job / "work", "passwd", link="/etc/passwd")
    put(job / "work", "leak", link=str(secret))
    result = diff(job)
    patch = result.patch_path.read_bytes()
    assert b"+/etc/passwd\n" in patch and b"root:" not in patch
    assert str(secret).encode() in patch and b"SECRET-MARKER" not in patch
    assert any("passwd points outside the project: /etc/passwd" in w for w in result.warnings)
    assert_roundtrip(job, result)


def test_symlinked_directory_is_not_entered(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "key").write_text("SECRET-MARKER\n")
    job = new_job(tmp_path)
    put(job / "input", "dir/a", b"a\n")
    put(job / "work", "dir", link=str(outside))
    put(job / "work", "up", link="../../outside")
    result = diff(job)
    patch = result.patch_path.read_bytes()
    assert b"SECRET-MARKER" not in patch and b"key" not in patch
    assert result.stat.paths == ["dir", "dir/a", "up"]
    assert sum("points outside the project" in w for w in result.warnings) == 2


@pytest.mark.parametrize("replacement", ["symlink", "file", "missing"])
def test_work_replaced_by_the_engine_is_refused(tmp_path: Path, replacement: str) -> None:
    job = new_job(tmp_path)
    put(job / "input", "a", b"a\n")
    shutil.rmtree(job / "work")
    if replacement == "symlink":
        (job / "work").symlink_to(job / "input")
    elif replacement == "file":
        (job / "work").write_text("x")
    with pytest.raises(FilaError, match=r"symlink|not a directory|not found"):
        diff(job)
    assert not (job / "DIFF.patch").exists()


def test_fifos_do_not_block_and_are_left_out(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "input", "was_a_file", b"x\n")
    os.mkfifo(job / "work" / "was_a_file")
    os.mkfifo(job / "work" / "pipe")
    put(job / "work", "ok.txt", b"ok\n")
    result = finishes(lambda: diff(job))
    assert result.stat.paths == ["ok.txt", "was_a_file"]  # the file is gone from work/
    assert sum("a FIFO, not a file" in w for w in result.warnings) == 2


def test_sparse_huge_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    with open(job / "work" / "huge", "wb") as f:
        f.truncate(1 << 40)
    with watch() as seen, pytest.raises(LimitExceeded, match=f"max_bytes={1 << 30}"):
        diff(job, max_work_bytes=1 << 30)
    assert not seen.read(job / "work" / "huge") and seen.processes == [], "no byte of it read, no git"
    assert not (job / "DIFF.patch").exists()


def test_more_entries_in_work_than_max_work_files_are_refused(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    for i in range(5):
        put(job / "work", f"d/{i}", b"")
    with pytest.raises(LimitExceeded, match="max_files=4"):
        diff(job, max_work_files=4)


def test_patch_over_max_diff_bytes_leaves_nothing_behind(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", "big.bin", os.urandom(200_000))
    with pytest.raises(LimitExceeded, match="max_diff_bytes=100000"):
        diff(job, max_diff_bytes=100_000)
    assert sorted(p.name for p in job.iterdir()) == ["input", "work"]
    assert not (job.parent / "scratch").exists()


def test_hardlinks_and_setuid_bits_are_flagged(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", "a", b"a\n")
    os.link(job / "work" / "a", job / "work" / "b")
    put(job / "work", "suid", b"#!/bin/sh\n", mode=0o4755)
    result = diff(job)
    assert sum("hard link" in w for w in result.warnings) == 2
    assert any("setuid/setgid/sticky bit of suid dropped" in w for w in result.warnings)
    assert b"new file mode 100755" in sections(result.patch_path.read_bytes())[b"a/suid b/suid"]
    assert_roundtrip(job, result)


def test_planted_gitattributes_and_git_config_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(base: Path, planted: bool) -> bytes:
        job = new_job(base)
        put(job / "input", "a.txt", b"one\ntwo\n")
        put(job / "work", "a.txt", b"one\r\nTWO\r\n")
        put(job / "input", "b.bin", b"\0" * 10)
        put(job / "work", "b.bin", b"\0" * 9 + b"\1")
        put(job / "work", "sub/c.txt", b"new\n")
        put(job / "input", "blank.txt", b"x\n\ny\n")  # a blank context line
        put(job / "work", "blank.txt", b"x\n\nz\n")
        if planted:
            attrs = b"* -diff\n* diff=x\n* text eol=crlf\n* filter=x\n*.txt binary\n"
            put(job / "work", ".gitattributes", attrs)
            put(job / "work", "sub/.gitattributes", b"* -text whitespace=fix ident\n")
            put(job / "input", "sub/.gitattributes", b"* diff=y\n")
            put(job / "work", ".git/config", b"[core]\n\tfsmonitor = touch PWNED\n")
            put(job / "work", ".git/info/attributes", b"* -diff\n")
        return diff(job).patch_path.read_bytes()

    clean = make(tmp_path / "clean", planted=False)
    # The host user's own git configuration and environment must not leak in either.
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    hostile = (b"[diff]\n\tnoprefix = true\n\tsuppressBlankEmpty = true\n\texternal = false\n"
               b"[core]\n\tattributesFile = /x\n\tquotePath = false\n")  # fmt: skip
    (home / ".gitconfig").write_bytes(hostile)
    (home / ".config" / "git" / "config").write_bytes(hostile)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'diff.noprefix'='true'")
    monkeypatch.setenv("GIT_DIR", str(tmp_path))
    planted = make(tmp_path / "planted", planted=True)
    ours = sections(planted)
    assert {k: v for k, v in ours.items() if b".gitattributes" not in k} == sections(clean)
    assert not list(tmp_path.rglob("PWNED"))


def test_gitattributes_and_dot_git_are_reported(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", ".gitattributes", b"* filter=x\n")
    put(job / "work", ".git/hooks/post-checkout", b"#!/bin/sh\n", mode=0o755)
    put(job / "work", "sub/.GIT/config", b"x")
    put(job / "work", "sub/.git. /x", b"x")
    put(job / "work", "sub/git~1", b"x")
    put(job / "work", ".gitmodules", link="/etc/passwd")
    result = diff(job)
    assert result.stat.paths == [".gitattributes"]
    assert any("changes .gitattributes" in w for w in result.warnings)
    shown = " ".join(result.warnings)
    for name in (".git ", "sub/.GIT ", "sub/.git. ", "sub/git~1 ", ".gitmodules "):
        assert f"not in the diff: {name}" in shown
    assert_roundtrip_ignoring(job, result, [".git", "sub", ".gitmodules"])


def assert_roundtrip_ignoring(job: Path, result: DiffResult, drop: list[str]) -> None:
    for name in drop:
        path = job / "work" / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    assert_roundtrip(job, result)


def test_denied_paths_are_left_out(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", ".env", b"TOKEN=x\n")
    put(job / "work", "keys/server.pem", b"x")
    put(job / "work", "ok.py", b"x\n")
    result = compute_diff(job, policy=policy(deny=[".env", "*.pem"]), scratch=tmp_path / "s",
                          skip=lambda rel, is_dir: rel == "fila")  # fmt: skip
    assert result.stat.paths == ["ok.py"]
    assert sum("deny rule" in w for w in result.warnings) == 2


def test_odd_names_round_trip_and_are_shown_escaped(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", "new\nline", b"x\n")
    put(job / "work", "esc\x1b[31mred", b"x\n")
    put(job / "work", b"bad\xff\xfeutf8", b"x\n")
    put(job / "work", "-leading-dash", b"x\n")
    put(job / "work", "rtl\u202etxt.exe", b"x\n")
    result = diff(job)
    assert set(result.stat.paths) == {"new\\nline", "esc\\x1b[31mred", "bad\\xff\\xfeutf8",
                                      "-leading-dash", "rtl\\u202etxt.exe"}  # fmt: skip
    assert all(p.isprintable() for p in result.stat.paths + result.warnings)
    assert sum("unusual file name" in w for w in result.warnings) == 4
    assert b'"b/new\\nline"' in result.patch_path.read_bytes()
    assert_roundtrip(job, result)
    result.stat.model_dump_json()  # the record is JSON: no lone surrogates may reach it


def test_planted_patch_symlink_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    job = new_job(tmp_path)
    put(job / "work", "a", b"a\n")
    (job / "DIFF.patch").symlink_to(victim)
    result = diff(job)
    assert victim.read_text() == "keep me\n"
    assert not result.patch_path.is_symlink() and b"+a" in result.patch_path.read_bytes()
    assert sorted(p.name for p in job.iterdir()) == ["DIFF.patch", "input", "work"]


def test_planted_patch_directory_is_an_error(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", "a", b"a\n")
    (job / "DIFF.patch").mkdir()
    with pytest.raises(FilaError, match="cannot write the patch"):
        diff(job)
    assert sorted(p.name for p in job.iterdir()) == ["DIFF.patch", "input", "work"]


def test_scratch_is_left_as_found(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "work", "a", b"a\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    compute_diff(job, policy=policy(), scratch=scratch)
    assert list(scratch.iterdir()) == []


def test_warnings_stop_at_a_hundred_and_count_the_rest(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    for i in range(150):
        os.mkfifo(job / "work" / f"p{i:03}")
    result = diff(job)
    assert len(result.warnings) == 101 and result.warnings[-1] == "... and 50 more warnings"


def test_a_changed_file_above_max_diff_bytes_never_reaches_git(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    put(job / "input", "same.bin", b"x" * 300_000)
    put(job / "work", "same.bin", b"x" * 300_000)
    put(job / "input", "grown.bin", b"small")
    put(job / "work", "grown.bin", b"small")
    put(job / "work", "small.txt", b"changed but small\n")
    assert diff(job, max_diff_bytes=100_000).stat.files == 1, "unchanged large files are fine"
    put(job / "work", "grown.bin", b"\0" * 300_000)
    with pytest.raises(LimitExceeded, match="changed file is 300000 bytes"):
        diff(job, max_diff_bytes=100_000)
    put(job / "input", "same.bin", b"y" * 300_000)
    with pytest.raises(LimitExceeded, match="changed file"):
        diff(job, max_diff_bytes=100_000)
