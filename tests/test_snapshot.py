"""Snapshots and overlay layers: a later task pays a stat pass, and the diff read from an overlay's
upper layer is byte for byte the diff of the full copy (real kernel overlays, mounted in a user
namespace with `userxattr`, as the Docker daemon mounts the job's `local` overlay volume)."""

from __future__ import annotations

import inspect
import marshal
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fila.core.errors import FilaError, LimitExceeded
from fila.core.layout import Root
from fila.core.models import Policy
from fila.queue.policy import load_policy, narrow
from fila.workspace import jobdir, overlay, snapshot, snapshot_gc
from fila.workspace.diff import DiffResult, compute_diff
from tests.support.policy import policy
from tests.support.project import make_project, make_root, shell_task
from tests.support.trees import DIRS, Node, build, tree_pairs

# --- the same change made on a copy and through a real overlay ----------------------------------


def _transform(root: bytes, before: dict, after: dict, recreate: list) -> None:
    """Make the tree at `root` (holding `before`) hold `after`: the engine's work. Directories in
    `recreate` are deleted and made again first (through an overlay: an opaque directory). Runs
    here on a copy and, by its source, inside the user namespace on the overlay's merged view."""
    import os as _os
    import shutil as _shutil

    def p(rel: str) -> bytes:
        return root + b"/" + _os.fsencode(rel)

    for d in recreate:
        if _os.path.isdir(p(d)) and not _os.path.islink(p(d)):
            _shutil.rmtree(p(d))
            _os.mkdir(p(d))
    for rel in before:
        if rel not in after and _os.path.lexists(p(rel)):
            _os.unlink(p(rel))
    for rel, node in after.items():
        path = p(rel)
        _os.makedirs(_os.path.dirname(path), exist_ok=True)
        if _os.path.lexists(path) and (node[0] == "link" or _os.path.islink(path)):
            _os.unlink(path)
        if node[0] == "link":
            _os.symlink(node[1], path)
            continue
        with open(path, "wb") as f:  # rewrites an unchanged file too: a copy-up that changes nothing
            f.write(node[1])
        _os.chmod(path, 0o755 if node[2] else 0o644)


_MOUNTED = """
import os, pickle, sys
{source}
args = pickle.loads(bytes.fromhex(sys.argv[1]))
_transform(*args)
"""


def overlay_possible() -> str | None:
    if not shutil.which("unshare"):
        return "no unshare(1)"
    d = Path(tempfile.mkdtemp())
    try:
        for sub in ("l", "u", "w", "m"):
            (d / sub).mkdir()
        res = _mount_run(d / "l", d / "u", d / "w", d / "m", "true")
        return None if res.returncode == 0 else f"no overlay in a user namespace: {res.stderr[-300:]!r}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _mount_run(lower: Path, upper: Path, work: Path, merged: Path, cmd: str) -> subprocess.CompletedProcess:
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},userxattr"
    script = f"mount -t overlay overlay -o {opts} {merged} && {cmd}"
    return subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, check=False)


def in_overlay(lower: Path, upper: Path, before: dict, after: dict, recreate: list) -> None:
    """Run _transform on `lower` seen through a fresh overlay whose upper layer is `upper`."""
    import pickle

    scratch, merged = upper.parent / "ovl-work", upper.parent / "merged"
    for d in (upper, scratch, merged):
        d.mkdir()
    code = _MOUNTED.format(source=inspect.getsource(_transform))
    arg = pickle.dumps((os.fsencode(merged), before, after, recreate)).hex()
    cmd = f"{sys.executable} -c {_sh(code)} {arg}"
    res = _mount_run(lower, upper, scratch, merged, cmd)
    assert res.returncode == 0, res.stderr.decode(errors="replace")


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def totals(tree: Path) -> tuple[int, int]:
    entries = size = 0
    for dirpath, dirs, files in os.walk(tree):
        for n in dirs + files:
            entries += 1
            st_ = os.lstat(os.path.join(dirpath, n))
            if stat.S_ISREG(st_.st_mode):
                size += st_.st_size
    return entries, size


def both(base: Path, before: dict, after: dict, recreate: list, pol: Policy) -> tuple[DiffResult, DiffResult]:
    """The diff of the same change by the copy strategy and by the overlay strategy."""
    copy = base / "copy"
    build(copy / "input", before)
    for d in DIRS:
        if d:
            (copy / "input" / d).mkdir(parents=True, exist_ok=True)
    shutil.copytree(copy / "input", copy / "work", symlinks=True)
    _transform(os.fsencode(copy / "work"), before, after, recreate)
    ovl = base / "ovl"
    (ovl / "job").mkdir(parents=True)
    lower = ovl / "lower"
    shutil.copytree(copy / "input", lower, symlinks=True)
    in_overlay(lower, ovl / "upper", before, after, recreate)
    n, size = totals(lower)
    layers = overlay.Layers(lower, ovl / "upper", entries=n, bytes_=size)
    a = compute_diff(copy, policy=pol, scratch=base / "s1")
    b = compute_diff(ovl / "job", policy=pol, scratch=base / "s2", layers=layers)
    return a, b


needs_overlay = pytest.mark.skipif(
    (why := overlay_possible()) is not None, reason=f"kernel overlay unavailable here: {why}"
)


@needs_overlay
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=tree_pairs(), recreate=st.lists(st.sampled_from([d for d in DIRS if d]), max_size=2, unique=True))
def test_overlay_and_copy_strategies_write_the_same_patch(
    tmp_path: Path, pair: tuple, recreate: list
) -> None:
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    a, b = both(base, pair[0], pair[1], recreate, policy(deny=[]))
    assert a.patch_path.read_bytes() == b.patch_path.read_bytes()
    assert a.stat == b.stat
    assert sorted(a.warnings) == sorted(b.warnings)


@needs_overlay
def test_overlay_upper_holds_only_changes_and_whiteouts_are_deletions(tmp_path: Path) -> None:
    before: dict[str, Node] = {
        "keep.txt": ("file", b"same\n", False),
        "gone.txt": ("file", b"bye\n", False),
        "d/old.txt": ("file", b"old\n", False),
        "d/ü/deep": ("file", b"deep\n", True),
        "link": ("link", "keep.txt"),
    }
    after: dict[str, Node] = {
        "keep.txt": ("file", b"same\n", True),  # a mode change only
        "d/new.txt": ("file", b"new\n", False),  # d/ deleted and made again: opaque
        "link": ("link", "elsewhere"),
        "fresh": ("file", b"\0binary", False),
    }
    a, b = both(tmp_path, before, after, ["d"], policy(deny=[]))
    patch = b.patch_path.read_bytes()
    assert patch == a.patch_path.read_bytes()
    assert sorted(b.stat.paths) == ["d/new.txt", "d/old.txt", "d/\\xfc/deep".replace("\\xfc", "ü"),
                                    "fresh", "gone.txt", "keep.txt", "link"]  # fmt: skip
    assert patch.count(b"deleted file mode") == 3 and patch.count(b"new file mode") == 2
    upper = tmp_path / "ovl" / "upper"
    whiteout = os.lstat(upper / "gone.txt")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(upper / "d", "user.overlay.opaque") == b"y"
    assert not (upper / "sub dir").exists()  # untouched: never copied up
    assert (tmp_path / "ovl" / "lower" / "gone.txt").read_bytes() == b"bye\n"  # the lower: untouched


@needs_overlay
def test_an_unchanged_overlay_reads_nothing_and_gives_an_empty_patch(tmp_path: Path) -> None:
    before = {f"d/f{i}": ("file", b"x" * i, False) for i in range(50)}
    a, b = both(tmp_path, before, before, [], policy(deny=[]))  # every file rewritten unchanged
    assert a.bytes == b.bytes == 0
    # Without the rewrite, the upper layer is empty and the snapshot is never walked.
    layers = overlay.Layers(tmp_path / "ovl" / "lower", tmp_path / "empty", entries=51, bytes_=1225)
    (tmp_path / "empty").mkdir()
    seen = list(layers.upper_walk(lambda r, d: False, max_files=100, max_bytes=1 << 20))
    assert seen == [] and list(layers.lower_walk(lambda r, d: False)) == []


@needs_overlay
def test_overlay_totals_are_held_to_max_work_files_as_the_copy_is(tmp_path: Path) -> None:
    before = {f"f{i}": ("file", b"x", False) for i in range(6)}
    grown = {**before, "g1": ("file", b"y", False), "g2": ("file", b"y", False)}
    # Allowed: 6 files, 4 directories (DIRS) and 2 new files = 12 entries, the limit.
    ok_copy, ok_ovl = both(tmp_path / "ok", before, grown, [], policy(deny=[], max_work_files=12))
    assert ok_copy.patch_path.read_bytes() == ok_ovl.patch_path.read_bytes() != b""
    # Blocked: one entry more than the limit, by both strategies.
    with pytest.raises(LimitExceeded, match="max_files=11"):  # the copy strategy (`both` runs it first)
        both(tmp_path / "no", before, grown, [], policy(deny=[], max_work_files=11))
    base = tmp_path / "ovl-only"
    (base / "job").mkdir(parents=True)
    build(base / "lower", before)
    in_overlay(base / "lower", base / "upper", before, grown, [])
    layers = overlay.Layers(base / "lower", base / "upper", entries=6, bytes_=6)
    with pytest.raises(LimitExceeded, match="max_files=7"):
        compute_diff(
            base / "job", policy=policy(deny=[], max_work_files=7), scratch=base / "s", layers=layers
        )


def test_an_upper_layer_with_a_redirect_xattr_is_refused(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    build(lower, {"d/a": ("file", b"a\n", False)})
    build(upper, {"d/a": ("file", b"b\n", False)})
    (tmp_path / "job").mkdir()
    pol = policy(deny=[])

    def run() -> DiffResult:
        layers = overlay.Layers(lower, upper, entries=2, bytes_=2)
        return compute_diff(tmp_path / "job", policy=pol, scratch=tmp_path / "s", layers=layers)

    assert b"+b" in run().patch_path.read_bytes()  # allowed: a plain upper layer
    try:
        os.setxattr(upper / "d", "user.overlay.redirect", b"/elsewhere")
    except OSError as err:
        pytest.skip(f"this filesystem keeps no user xattrs: {err}")
    with pytest.raises(FilaError, match=r"user\.overlay\.redirect"):
        run()


def test_a_whiteout_made_by_hand_is_a_deletion_and_a_fifo_is_not_a_file(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("mknod of a 0/0 character device needs root")
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    build(lower, {"a": ("file", b"a\n", False), "b": ("file", b"b\n", False)})
    upper.mkdir()
    os.mknod(upper / "a", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    os.mkfifo(upper / "pipe")
    (tmp_path / "job").mkdir()
    layers = overlay.Layers(lower, upper, entries=2, bytes_=4)
    d = compute_diff(tmp_path / "job", policy=policy(deny=[]), scratch=tmp_path / "s", layers=layers)
    assert d.stat.paths == ["a"] and b"deleted file mode" in d.patch_path.read_bytes()
    assert any("pipe" in w and "FIFO" in w for w in d.warnings)


# --- the snapshot store ----------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Root:
    r = make_project(tmp_path).require()
    src = tmp_path / "src"
    (src / "empty").mkdir(parents=True)
    (src / "a.py").write_text("print('hello')\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / ".env").write_text("SECRET=1\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref\n")
    os.symlink("a.py", src / "inner-link")
    os.mkfifo(src / "pipe")
    old = time.time() - 3600  # older than the racy window: the stat data is trusted
    for p in (tmp_path / "greeting.txt", src / "a.py", src / "run.sh"):
        os.utime(p, (old, old))
    return r


def take(root: Root, tid: str, targets: list[str] | None = None) -> snapshot.Snapshot:
    task = shell_task(targets=targets or ["greeting.txt", "src"])
    pol, _ = load_policy(root, "default")
    project = jobdir.project_of(root, task, pol)
    return snapshot.take(root, tid, project, jobdir.resolve_targets(root, project, task.targets, pol), pol,
                         owner=None)  # fmt: skip


def listing(tree: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirs, files in os.walk(tree):
        for n in dirs + files:
            p = Path(dirpath, n)
            st_ = p.lstat()
            kind = "link" if p.is_symlink() else ("dir" if p.is_dir() else "file")
            data = os.readlink(p) if kind == "link" else (p.read_bytes() if kind == "file" else b"")
            out[str(p.relative_to(tree))] = (kind, data, stat.S_IMODE(st_.st_mode) if kind != "link" else 0)
    return out


def test_a_snapshot_holds_what_prepare_copies_into_input(root: Root) -> None:
    task = shell_task(targets=["greeting.txt", "src"])
    pol, _ = load_policy(root, "default")
    prep = jobdir.prepare(root, "copy1", task, pol, narrow(pol, task))
    copy_manifest = jobdir.read_manifest(root, "copy1")
    snap = take(root, "ovl1")
    assert listing(snap.tree) == listing(prep.job_dir / "input")
    assert ".env" not in listing(snap.tree) and "src/empty" in listing(snap.tree)
    mine = jobdir.read_manifest(root, "ovl1")
    assert mine["entries"] == copy_manifest["entries"] and mine["project"] == copy_manifest["project"]
    assert (snap.files, snap.bytes) == (prep.files, prep.bytes)
    assert sorted(snap.warnings) == sorted(prep.warnings)


def test_a_later_task_on_an_unchanged_project_reads_no_file(root: Root) -> None:
    first = take(root, "t1")
    assert first.how == "built" and first.hashed == 3
    again = take(root, "t2")
    assert again.how == "reused" and again.hashed == 0 and again.key == first.key
    # The jobs hold the snapshot by a link of its manifest: apply reads the same file.
    assert os.path.samefile(root.meta("t2") / "manifest.json", first.manifest)
    assert first.manifest.stat().st_nlink == 3


def test_a_changed_file_is_read_again_and_the_rest_is_shared(root: Root) -> None:
    first = take(root, "t1")
    a = root.path / "src" / "a.py"
    old = a.stat()
    a.write_text("print('HELLO')\n")  # same size
    os.utime(a, ns=(old.st_atime_ns, old.st_mtime_ns))  # and the same mtime: ctime still moves
    second = take(root, "t2")
    assert second.key != first.key and second.how == "built"
    assert (second.tree / "src" / "a.py").read_text() == "print('HELLO')\n"
    assert (first.tree / "src" / "a.py").read_text() == "print('hello')\n"  # never written again
    assert os.path.samefile(first.tree / "greeting.txt", second.tree / "greeting.txt")
    assert second.hashed == 2  # a.py checked, then copied; nothing else read
    a.write_text("print('hello')\n")  # back to the first state: that snapshot again
    assert take(root, "t3").key == first.key


def test_a_file_rewritten_within_the_racy_window_is_not_trusted_to_its_stat(root: Root) -> None:
    f = root.path / "src" / "fresh.txt"
    f.write_text("one\n")
    first = take(root, "t1")
    st_ = f.stat()
    f.write_text("two\n")
    os.utime(f, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    second = take(root, "t2")
    assert (second.tree / "src" / "fresh.txt").read_text() == "two\n" and second.key != first.key
    # The counterpart: stat data older than the window is trusted, nothing is read.
    assert take(root, "t3").hashed <= 1  # fresh.txt only, still young


def test_a_new_empty_directory_or_a_retargeted_link_is_a_new_snapshot(root: Root) -> None:
    first = take(root, "t1")
    (root.path / "src" / "new-dir").mkdir()
    second = take(root, "t2")
    assert second.key != first.key and (second.tree / "src" / "new-dir").is_dir()
    link = root.path / "src" / "inner-link"
    link.unlink()
    os.symlink("run.sh", link)
    third = take(root, "t3")
    assert third.key != second.key and os.readlink(third.tree / "src" / "inner-link") == "run.sh"


def test_the_snapshot_belongs_to_the_engine_uid_when_fila_runs_as_root(root: Root) -> None:
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    task = shell_task(targets=["src"])
    pol, _ = load_policy(root, "default")
    project = jobdir.project_of(root, task, pol)
    mine = take(root, "t1", ["src"])
    theirs = snapshot.take(root, "t2", project, ["src"], pol, owner=(65534, 65534))
    assert theirs.key != mine.key  # the owner is part of what a snapshot is
    for p in [theirs.tree, *theirs.tree.rglob("*")]:
        assert p.lstat().st_uid == 65534, p
    assert (mine.tree / "src" / "a.py").stat().st_uid == 0


def test_no_host_process_of_the_engine_uid_reaches_the_snapshots_it_owns() -> None:
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    top = Path(tempfile.mkdtemp())
    try:
        os.chmod(top, 0o755)  # reachable by anyone down to sandbox/, as a project directory is
        r = make_root(top).require()
        (top / "a.txt").write_text("secret source\n")
        pol, _ = load_policy(r, "default")
        snap = snapshot.take(r, "t1", top, ["a.txt"], pol, owner=(65534, 65534))
        target = snap.tree / "a.txt"
        assert target.stat().st_uid == 65534

        def as_nobody(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(argv, capture_output=True, user=65534, group=65534, check=False)

        assert as_nobody("ls", str(top / "sandbox")).returncode == 0  # allowed: up to the store
        res = as_nobody("cat", str(target))  # blocked: the store is 0700, the file's owner or not
        assert res.returncode != 0 and b"Permission denied" in res.stderr
        assert stat.S_IMODE(snapshot.store(r).stat().st_mode) == 0o700
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_gc_removes_a_snapshot_only_once_no_job_links_it(root: Root) -> None:
    first = take(root, "t1")
    take(root, "t2")
    assert snapshot_gc.collect(root) == []  # linked by two jobs: kept
    (root.meta("t1") / "manifest.json").unlink()
    assert snapshot_gc.collect(root) == []  # still linked by t2
    (root.meta("t2") / "manifest.json").unlink()
    assert snapshot_gc.collect(root, dry_run=True)[0].key == first.key and first.path.exists()
    gone = snapshot_gc.collect(root)
    assert [g.key for g in gone] == [first.key] and not first.path.exists()
    again = take(root, "t3")  # the stat cache names a collected snapshot: built again
    assert again.how == "built" and again.key == first.key


def test_limits_hold_as_for_the_copy(root: Root) -> None:
    task = shell_task(targets=["src"])
    pol, _ = load_policy(root, "default")
    project = jobdir.project_of(root, task, pol)
    for n, fits in ((7, True), (6, False)):  # src/ lists 7 names
        p = pol.model_copy(update={"max_work_files": n})
        outcomes = []
        for strategy in ("copy", "snapshot"):
            try:
                if strategy == "copy":
                    jobdir.prepare(root, f"c{n}", task, p, narrow(p, task))
                else:
                    snapshot.take(root, f"s{n}", project, ["src"], p, owner=None)
                outcomes.append("ok")
            except LimitExceeded as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1] and (outcomes[0] == "ok") == fits, outcomes


def test_the_stat_cache_is_private_to_the_host(root: Root) -> None:
    take(root, "t1")
    (cache,) = (snapshot.store(root) / "stat").iterdir()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    assert marshal.loads(cache.read_bytes())["key"] == take(root, "t2").key


# --- a job on the overlay strategy, on the real Docker daemon ------------------------------------

_ENGINE_CHANGE = (
    "set -e; sed -i s/hello/world/ greeting.txt; rm src/gone.txt; chmod +x src/a.py; "
    "rm -r src/sub; mkdir src/sub; echo fresh > src/sub/new.txt; ln -s greeting.txt link; "
    "mv src/keep.txt src/moved.txt; if echo x > ../input/greeting.txt; then echo WROTE-INPUT; fi"
)


@pytest.fixture
def docker_proj(tmp_path: Path, shell_image: object) -> Path:
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    (tmp_path / "src" / "sub").mkdir(parents=True)
    for name, text in (("a.py", "print(1)\n"), ("gone.txt", "bye\n"), ("keep.txt", "keep\n")):
        (tmp_path / "src" / name).write_text(text)
    (tmp_path / "src" / "sub" / "old.txt").write_text("old\n")
    old = time.time() - 3600  # a project at rest: older than the racy window
    for p in [tmp_path / "greeting.txt", *(tmp_path / "src").rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)
    return tmp_path


def _run_one(proj: Path, env: dict[str, str] | None = None) -> dict:
    from tests.support.cli import fila, submit_shell
    from tests.support.project import record

    tid = submit_shell(proj, _ENGINE_CHANGE, "greeting.txt", "src")
    res = fila(proj, "run", "--once", env=env)
    assert res.exit_code == 0, res.output
    return record(proj, tid)


@pytest.mark.docker
def test_an_overlay_job_writes_the_patch_the_copy_writes_and_leaves_the_snapshot_pristine(
    docker_proj: Path, docker_client: object
) -> None:
    copied = _run_one(docker_proj, env={"FILA_WORKSPACE": "copy"})
    assert copied["workspace"] == {"strategy": "copy", "why": "FILA_WORKSPACE=copy", "snapshot": None,
                                   "snapshot_how": None, "files_read": None}  # fmt: skip
    over = _run_one(docker_proj)
    ws = over["workspace"]
    assert ws["strategy"] == "overlay" and ws["snapshot_how"] == "built", ws
    assert over["status"] == copied["status"] == "needs_review"
    assert (docker_proj / over["patch_path"]).read_bytes() == (
        docker_proj / copied["patch_path"]
    ).read_bytes()
    assert over["diffstat"] == copied["diffstat"] and len(over["diffstat"]["paths"]) == 8
    root = Root.at(docker_proj)
    ov = overlay.job_overlay(root, over["id"])
    assert ov is not None
    # input/ stayed pristine and read-only: the engine's write failed, the snapshot is as taken.
    assert "WROTE-INPUT" not in (docker_proj / over["log_path"]).read_text()
    assert (ov.lower / "greeting.txt").read_text() == "hello\n"
    assert (ov.lower / "src" / "sub" / "old.txt").read_text() == "old\n"
    # The upper layer holds the changes only: the untouched file was never copied up.
    assert not (ov.upper / "src" / "a.py").exists() or (ov.upper / "src" / "a.py").stat().st_mode & 0o100
    assert not (ov.upper / "src" / "keep.txt").is_file()  # renamed away: a whiteout, not a file
    # The job's volume went with its container.
    vols = docker_client.volumes.list(filters={"label": f"fila.root={docker_proj}"})  # type: ignore[attr-defined]
    assert vols == []
    # A second task on the unchanged project reuses the snapshot after a stat pass.
    again = _run_one(docker_proj)
    assert again["workspace"]["snapshot"] == ws["snapshot"] and again["workspace"]["snapshot_how"] == "reused"
    assert again["workspace"]["files_read"] == 0


@pytest.mark.docker
def test_apply_of_an_overlay_job_lands_the_reviewed_change(docker_proj: Path) -> None:
    from tests.support.cli import fila

    rec = _run_one(docker_proj)
    assert rec["workspace"]["strategy"] == "overlay"
    res = fila(docker_proj, "apply", rec["id"], "--yes", "--by", "alice", "--reason", "ok")
    assert res.exit_code == 0, res.output
    assert (docker_proj / "greeting.txt").read_text() == "world\n"
    assert not (docker_proj / "src" / "gone.txt").exists() and not (docker_proj / "src" / "keep.txt").exists()
    assert (docker_proj / "src" / "moved.txt").read_text() == "keep\n"
    assert sorted(p.name for p in (docker_proj / "src" / "sub").iterdir()) == ["new.txt"]
    assert os.readlink(docker_proj / "link") == "greeting.txt"
    assert (docker_proj / "src" / "a.py").stat().st_mode & 0o100


@pytest.mark.docker
def test_apply_refuses_an_overlay_job_whose_upper_layer_changed_after_review(docker_proj: Path) -> None:
    from tests.support.cli import fila

    rec = _run_one(docker_proj)
    ov = overlay.job_overlay(Root.at(docker_proj), rec["id"])
    assert ov is not None
    (ov.upper / "greeting.txt").write_text("tampered\n")
    res = fila(docker_proj, "apply", rec["id"], "--yes", "--by", "alice", "--reason", "ok")
    assert res.exit_code != 0 and "work/" in res.output, res.output
    assert (docker_proj / "greeting.txt").read_text() == "hello\n"


def _age(*paths: Path) -> None:
    old = time.time() - 3600
    for top in paths:
        for p in [top, *(top.rglob("*") if top.is_dir() else [])]:
            os.utime(p, (old, old), follow_symlinks=False)


def test_a_later_task_is_one_stat_pass_that_lists_and_reads_nothing(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    _age(root.path / "greeting.txt", root.path / "src")
    first = take(root, "t1")

    def walked(*_a: object, **_k: object) -> None:
        raise AssertionError("the project was listed again")

    with monkeypatch.context() as m:
        m.setattr(snapshot, "_walk", walked)
        again = take(root, "t2")  # allowed: nothing changed, so no listing, no rule, no read
        assert again.key == first.key and again.how == "reused" and again.warnings == first.warnings
        a = root.path / "src" / "a.py"
        old = a.stat()
        a.write_text("print('HELLO')\n")  # same size, and the times put back: the ctime moves
        os.utime(a, ns=(old.st_atime_ns, old.st_mtime_ns))
        with pytest.raises(AssertionError, match="listed again"):
            take(root, "t3")  # blocked: the stat pass saw the change and wants the full scan
    changed = take(root, "t3")
    assert changed.key != first.key and (changed.tree / "src" / "a.py").read_text() == "print('HELLO')\n"


def test_a_new_file_is_found_even_when_its_directory_times_are_put_back(root: Root) -> None:
    _age(root.path / "greeting.txt", root.path / "src")
    first = take(root, "t1")
    d = root.path / "src" / "empty"
    before = d.stat()
    (d / "new.txt").write_text("new\n")
    _age(d / "new.txt")
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime back; the ctime cannot go
    second = take(root, "t2")
    assert second.key != first.key and (second.tree / "src" / "empty" / "new.txt").read_text() == "new\n"
