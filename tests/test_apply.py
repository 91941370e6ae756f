"""The review gate's decisions on a real Docker engine: apply lands exactly what was reviewed or
nothing at all; reject and apply are recorded once; gc removes only decided jobs."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fila.core.errors import ApplyRefused, InvalidTransition
from fila.core.layout import Root
from fila.review import apply as apply_mod
from fila.review import landing, patch
from fila.workspace import overlay as fsnap
from fila.workspace.safedir import SafeDir
from tests.support.cli import fila, run_shell
from tests.support.project import make_root, record

docker = pytest.mark.docker


def events(root: Path, tid: str) -> list[dict]:
    lines = (root / "fila" / "logs" / f"{tid}.events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def snapshot(base: Path, skip: tuple[str, ...] = ("fila", "sandbox")) -> dict[str, tuple]:
    """Every entry below base (symlinks not followed): kind, permission bits, bytes or target."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(base):
        if Path(dirpath) == base:
            dirs[:] = [d for d in dirs if d not in skip]
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = p.relative_to(base).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_mode & 0o7777, p.read_bytes())
            else:
                out[rel] = ("dir", st.st_mode & 0o7777)
    return out


def files_of(snap: dict[str, tuple], prefixes: tuple[str, ...] = ("",)) -> dict[str, tuple]:
    return {k: v for k, v in snap.items() if v[0] != "dir" and k.startswith(prefixes)}


# The two workspace strategies a Docker job may run on: the copy (forced) and the default, the
# overlay on a shared snapshot. apply reads work/ differently on each, so what lands is proven on both.
STRATEGIES = [
    pytest.param(({"FILA_WORKSPACE": "copy"}, "copy"), id="copy"),
    pytest.param(({}, "overlay"), id="overlay"),
]


def assert_targets_hold_exactly_work(root: Path, tid: str, prefixes: tuple[str, ...]) -> None:
    """The project's targets hold exactly what the engine left in work/: the job copy compared entry
    by entry (modes, bytes, link targets), or an overlay job's merged view (the upper layer over the
    snapshot, read by overlay.MergedView) compared by kind, git mode and sha256 of every file's
    bytes or link's target, each path of either layer checked."""
    got = files_of(snapshot(root), prefixes)
    ov = fsnap.job_overlay(Root.at(root), tid)
    if ov is None:
        assert got == files_of(snapshot(root / "sandbox" / "jobs" / tid / "work"))
        return
    rels = set(snapshot(ov.lower)) | set(snapshot(ov.upper))
    with fsnap.MergedView(ov) as merged, SafeDir(root) as here:
        work = {r: s for r in rels if (s := merged.state(r, max_bytes=1 << 30)).kind not in ("absent", "dir")}
        assert sorted(work) == sorted(got)
        assert {r: here.state(r, max_bytes=1 << 30) for r in got} == work


def forge_patch(root: Path, tid: str, text: bytes) -> None:
    """Replace DIFF.patch AND its sha256 in the record: what follows tests the safety checks,
    not the integrity check."""
    (root / "sandbox" / "jobs" / tid / "DIFF.patch").write_bytes(text)
    rec_path = root / "fila" / "out" / f"{tid}.json"
    rec = json.loads(rec_path.read_text())
    rec["patch_sha256"] = hashlib.sha256(text).hexdigest()
    rec_path.write_text(json.dumps(rec))


@pytest.fixture
def proj(proj: Root) -> Path:
    """The shared queue root (conftest), as the path this module's tests build on."""
    return proj.path


# -- round trip --------------------------------------------------------------------------------

ROUND_TRIP = r"""set -e
sed -i 's/hello/world/' greeting.txt
printf '\000\001\002binary\377' > src/bin.dat
printf '\377\376changed' > src/blob.bin
printf '#!/bin/sh\necho hi\n' > src/run.sh; chmod +x src/run.sh
chmod -x src/tool.sh
echo b2 > src/a.txt; chmod +x src/a.txt
rm src/gone.txt
mv src/old.txt "src/new name é.txt"
mv "src/with space.txt" "src/日本語 名前.txt"
echo more >> "src/ünïcödé.txt"
rm src/link; ln -s ../greeting.txt src/link
ln -s a.txt src/newlink
rm -r src/d; echo file > src/d
rm src/f; mkdir src/f; echo inner > src/f/g
rm src/ln2; echo now a file > src/ln2
mkdir -p "src/new dir/deep"; echo nested > "src/new dir/deep/x y.txt"
: > src/empty.txt
printf 'not utf-8\n' > "$(printf 'src/bad\377name')"
echo '# also staged, so it could act on the staged files' >> src/.gitattributes
"""


def make_round_trip_project(root: Path) -> None:
    src = root / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.txt").write_text("a\nb\nc\n")
    (src / "blob.bin").write_bytes(bytes(range(256)))
    (src / "tool.sh").write_text("#!/bin/sh\n")
    (src / "tool.sh").chmod(0o755)
    (src / "gone.txt").write_text("old\n")
    (src / "old.txt").write_text("move me\n")
    (src / "with space.txt").write_text("spaced\n")
    (src / "ünïcödé.txt").write_text("unicode\n")
    (src / "d" / "only").write_text("x\n")
    (src / "f").write_text("a file first\n")
    # Attributes in the project must not change what git apply writes (no CRLF conversion here).
    (src / ".gitattributes").write_text("* text eol=crlf\n*.txt ident\n")
    os.symlink("a.txt", src / "link")
    os.symlink("a.txt", src / "ln2")


@docker
@pytest.mark.parametrize("workspace", STRATEGIES)
@pytest.mark.quick
def test_apply_lands_exactly_work_byte_for_byte_with_modes(proj: Path, workspace: tuple[dict, str]) -> None:
    env, strategy = workspace
    make_round_trip_project(proj)
    untouched = files_of(snapshot(proj), ("policies/",))
    tid = run_shell(proj, ROUND_TRIP, "greeting.txt", "src", env=env)
    assert record(proj, tid)["workspace"]["strategy"] == strategy
    res = fila(proj, "apply", tid, "--yes", "--by", "alice", "--reason", "looks right")
    assert res.exit_code == 0, res.output
    assert_targets_hold_exactly_work(proj, tid, ("greeting.txt", "src/"))
    got = snapshot(proj)
    assert got["src/run.sh"][1] == 0o755 and got["src/tool.sh"][1] == 0o644
    assert got["src/a.txt"][1] == 0o755 and got["src/bin.dat"][2] == b"\0\1\2binary\377"
    assert got["src/link"] == ("link", "../greeting.txt") and got["src/f/g"][2] == b"inner\n"
    assert "src/old.txt" not in got and "src/gone.txt" not in got and "src/d/only" not in got
    assert files_of(snapshot(proj), ("policies/",)) == untouched
    rec = record(proj, tid)
    assert rec["status"] == "applied"
    assert rec["decision"]["by"] == "alice" and rec["decision"]["reason"] == "looks right"
    applied = [e for e in events(proj, tid) if e["event"] == "applied"]
    assert len(applied) == 1 and applied[0]["decision"]["action"] == "applied"
    meta = proj / "sandbox" / "meta" / tid
    assert not (meta / "applying.json").exists() and not (meta / "apply").exists()
    assert (proj / "sandbox" / "jobs" / tid / "work").is_dir()  # kept until gc
    ov = fsnap.job_overlay(Root.at(proj), tid)
    assert (ov is None) == (strategy == "copy") and (ov is None or ov.upper.is_dir())  # the upper too
    assert os.fsdecode(b"src/bad\377name") in got


@docker
def test_apply_of_an_empty_diff_records_the_decision_and_writes_nothing(proj: Path) -> None:
    tid = run_shell(proj, "true")
    before = snapshot(proj)
    res = fila(proj, "apply", tid, "--yes", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["written"] == [] and record(proj, tid)["status"] == "applied"
    assert snapshot(proj) == before


@docker
def test_project_gitattributes_do_not_change_what_lands(proj: Path) -> None:
    # Without fila's attribute override git apply writes CRLF here (and the work/ check refuses).
    (proj / ".gitattributes").write_text("* text eol=crlf\n")
    (proj / "f.txt").write_text("a\n")
    tid = run_shell(proj, "echo '# x' >> .gitattributes; echo b >> f.txt", ".gitattributes", "f.txt")
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 0, res.output
    assert (proj / "f.txt").read_bytes() == b"a\nb\n"
    assert (proj / ".gitattributes").read_bytes() == b"* text eol=crlf\n# x\n"


# -- integrity and moved base ------------------------------------------------------------------


@docker
@pytest.mark.quick
def test_apply_refuses_a_tampered_patch(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    p = proj / "sandbox" / "jobs" / tid / "DIFF.patch"
    p.write_bytes(p.read_bytes().replace(b"+world", b"+pwned"))
    before = snapshot(proj)
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4
    assert "does not match the sha256 in the record" in res.stderr
    assert snapshot(proj) == before
    assert record(proj, tid)["status"] == "needs_review"


@docker
@pytest.mark.quick
def test_apply_refuses_moved_base_and_writes_nothing(proj: Path) -> None:
    (proj / "notes.txt").write_text("notes\n")
    (proj / "lib").mkdir()
    (proj / "lib" / "util.py").write_text("x = 1\n")
    tid = run_shell(
        proj,
        "echo world > greeting.txt; echo new > lib/new.py; echo y=2 >> lib/util.py",
        "greeting.txt",
        "notes.txt",
        "lib",
    )
    (proj / "greeting.txt").write_text("hello there\n")  # touched by the patch
    (proj / "notes.txt").write_text("edited meanwhile\n")  # not touched, but copied
    (proj / "lib" / "new.py").write_text("someone else's\n")  # the patch creates it
    before = snapshot(proj)
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4, res.output
    assert "moved base" in res.stderr
    for name in ("greeting.txt", "notes.txt", "lib/new.py"):
        assert name in res.stderr
    assert "lib/util.py" not in res.stderr
    assert snapshot(proj) == before
    assert record(proj, tid)["status"] == "needs_review"


@docker
def test_apply_refuses_a_mode_change_in_the_project_as_a_moved_base(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    (proj / "greeting.txt").chmod(0o755)
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4 and "mode 644 -> 755" in res.stderr


@docker
def test_apply_3way_merges_a_moved_base_and_refuses_conflicts(proj: Path) -> None:
    lines = "".join(f"line {i}\n" for i in range(1, 11))
    (proj / "doc.txt").write_text(lines)
    (proj / "other.txt").write_text(lines)
    tid = run_shell(proj, "sed -i 's/^line 1$/LINE ONE/' doc.txt other.txt", "doc.txt", "other.txt")
    (proj / "doc.txt").write_text(lines.replace("line 9\n", "line nine\n"))  # merges cleanly
    (proj / "other.txt").write_text(lines.replace("line 1\n", "line uno\n"))  # conflicts
    before = snapshot(proj)
    res = fila(proj, "apply", tid, "--yes", "--3way")
    assert res.exit_code == 4 and "conflicts" in res.stderr and "other.txt" in res.stderr
    assert snapshot(proj) == before
    (proj / "other.txt").write_text(lines)  # the conflicting change is undone
    res = fila(proj, "apply", tid, "--yes", "--3way", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["merged"] == ["doc.txt"] and out["status"] == "applied"
    assert (proj / "doc.txt").read_text() == lines.replace("line 1\n", "LINE ONE\n").replace(
        "line 9\n", "line nine\n"
    )
    assert (proj / "other.txt").read_text() == lines.replace("line 1\n", "LINE ONE\n")


# -- hostile patches ---------------------------------------------------------------------------

NEW_FILE = b"""diff --git a/%(p)s b/%(p)s
new file mode %(m)s
index 0000000000000000000000000000000000000000..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391
--- /dev/null
+++ b/%(p)s
@@ -0,0 +1 @@
+%(c)s
"""


def new_file(path: bytes, content: bytes = b"evil", mode: bytes = b"100644") -> bytes:
    return NEW_FILE % {b"p": path, b"c": content, b"m": mode}


NEW_LINK = b"""diff --git a/%(p)s b/%(p)s
new file mode 120000
index 0000000000000000000000000000000000000000..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391
--- /dev/null
+++ b/%(p)s
@@ -0,0 +1 @@
+%(t)s
\\ No newline at end of file
"""

HOSTILE = {
    "path escape": (new_file(b"../evil"), "'..'"),
    "absolute path": (new_file(b"/fila-evil"), "absolute"),
    "git hook": (new_file(b".git/hooks/pre-commit", b"#!/bin/sh", b"100755"), ".git"),
    "git hook, case": (new_file(b".GIT/hooks/pre-commit", b"#!/bin/sh", b"100755"), ".git"),
    "symlink then write through it": (
        NEW_LINK % {b"p": b"link", b"t": b"/etc"} + new_file(b"link/x"),
        "symlink",
    ),
    "symlink out of the project": (NEW_LINK % {b"p": b"up", b"t": b"../../.."}, "outside"),
    "escape sequence in a name": (
        new_file(b'"\\033[31mred"').replace(b'a/"', b'"a/').replace(b'b/"', b'"b/'),
        "control character",
    ),
    "setuid file": (new_file(b"suid", mode=b"104755"), "setuid"),
    "fila's own queue": (new_file(b"fila/in/evil.json", b"{}"), "fila's own"),
    "fila's own policy": (new_file(b"policies/default.json", b"{}"), "fila's own"),
    "symlink to an unreviewed job file": (
        NEW_LINK % {b"p": b"conftest.py", b"t": b"sandbox/jobs/x/payload.py"},
        "fila's own",
    ),
    "a denied secret": (new_file(b".env", b"TOKEN=x"), "denies"),
    "a rename": (
        b"diff --git a/greeting.txt b/other\nsimilarity index 100%\nrename from "
        b"greeting.txt\nrename to other\n",
        None,
    ),
}


@docker
@pytest.mark.parametrize("case", list(HOSTILE))
def test_apply_refuses_a_hostile_patch(proj: Path, case: str) -> None:
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    tid = run_shell(proj, "echo world > greeting.txt")
    text, why = HOSTILE[case]
    forge_patch(proj, tid, text)
    before, beside = snapshot(proj), sorted(os.listdir(proj.parent))
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4, res.output
    if why:
        assert why in res.stderr, res.stderr
    assert snapshot(proj) == before  # .git/ included
    assert sorted(os.listdir(proj.parent)) == beside
    assert record(proj, tid)["status"] == "needs_review"
    assert not (proj / "sandbox" / "meta" / tid / "applying.json").exists()


@docker
@pytest.mark.parametrize(
    "case",
    [
        "path escape",
        "git hook",
        "symlink then write through it",
        "symlink out of the project",
        "fila's own queue",
    ],
)
def test_hostile_patches_are_refused_even_without_the_path_checks(
    proj: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Defence in depth: git apply in staging, the comparison with work/ and the symlink check
    # of the staged result each refuse on their own.
    monkeypatch.setattr(apply_mod._Plan, "check_paths", lambda self: None)
    tid = run_shell(proj, "echo world > greeting.txt")
    forge_patch(proj, tid, HOSTILE[case][0])
    before, beside = snapshot(proj), sorted(os.listdir(proj.parent))
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4, res.output
    assert snapshot(proj) == before
    assert sorted(os.listdir(proj.parent)) == beside


@docker
def test_apply_refuses_to_write_through_a_symlinked_directory_in_the_project(proj: Path) -> None:
    outside = proj.parent / f"elsewhere-{proj.name}"
    outside.mkdir()
    tid = run_shell(proj, "echo world > greeting.txt")
    os.symlink(outside, proj / "docs")
    forge_patch(proj, tid, new_file(b"docs/x"))
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4 and "is a symlink in the project" in res.stderr
    assert list(outside.iterdir()) == []


def test_patch_parser_refuses_what_fila_never_writes() -> None:
    good = new_file(b"ok.txt")
    assert [f.path for f in patch.parse(good).files] == ["ok.txt"]
    for bad in (
        b"junk\n" + good,
        good.replace(b"100644", b"100664"),
        b"diff --git a/x b/x\nnew file mode 100644\nindex 0000000..1111111\n"
        b"Binary files /dev/null and b/x differ\n",
        good.replace(b"@@ -0,0 +1 @@", b"@@ -0,0 +1,3 @@"),
        b"diff --git a/x b/y\nold mode 100644\nnew mode 100755\n",
    ):
        with pytest.raises(patch.PatchError):
            patch.parse(bad)
    quoted = patch.parse(new_file(b'"sp ace \\303\\251"').replace(b'a/"', b'"a/')
                         .replace(b'b/"', b'"b/'))  # fmt: skip
    assert quoted.files[0].path == "sp ace é"


def test_unsafe_paths_are_named_with_their_reason() -> None:
    def why(p: str) -> str | None:
        return patch.unsafe_path(p, deny=[".env"], reserved=["fila", "sandbox"])

    assert why("src/a.py") is None and why("docs/naïve café.txt") is None
    assert "absolute" in (why("/etc/passwd") or "")
    assert ".." in (why("a/../../b") or "")
    for p in (".git/config", "sub/.Git/hooks/x", ".git./x", "git~1/x"):
        assert ".git" in (why(p) or ""), p
    assert "control" in (why("a\x1bb") or "")
    assert "fila's own" in (why("sandbox/jobs/x") or "")
    assert "denies" in (why("conf/.env") or "")
    assert patch.link_escapes("a/b", b"../../x") and patch.link_escapes("a", b"/etc")
    assert patch.link_escapes("a/b", b"../c") is None


# -- atomicity and crashes ---------------------------------------------------------------------


@docker
def test_a_failed_write_rolls_back_every_file(proj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_round_trip_project(proj)
    tid = run_shell(proj, ROUND_TRIP, "greeting.txt", "src")
    before = snapshot(proj)
    real, calls = SafeDir.put_file, []

    def flaky(self: SafeDir, rel: str, *a: object, **kw: object) -> str:
        if self.root == proj:
            calls.append(rel)
            if len(calls) == 5:
                raise OSError(28, "No space left on device")
        return real(self, rel, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SafeDir, "put_file", flaky)
    with pytest.raises(ApplyRefused, match="every file was put back"):
        apply_mod.apply(Root.at(proj), tid, by="alice")
    assert snapshot(proj) == before
    assert record(proj, tid)["status"] == "needs_review"
    assert "apply rolled back" in [e["event"] for e in events(proj, tid)]
    monkeypatch.setattr(SafeDir, "put_file", real)
    assert apply_mod.apply(Root.at(proj), tid, by="alice").record.status == "applied"


@docker
@pytest.mark.parametrize("workspace", STRATEGIES)
def test_an_apply_killed_midway_is_finished_by_the_next_apply(
    proj: Path, workspace: tuple[dict, str]
) -> None:
    env, strategy = workspace
    make_round_trip_project(proj)
    tid = run_shell(proj, ROUND_TRIP, "greeting.txt", "src", env=env)
    assert record(proj, tid)["workspace"]["strategy"] == strategy
    before = snapshot(proj)
    cmd = [sys.executable, "-c", "from fila.cli import main; main()", "apply", tid, "--yes",
           "--root", str(proj)]  # fmt: skip
    res = subprocess.run(cmd, env={**os.environ, "FILA_CRASH_AT": "apply_after_write"},
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert res.returncode == -9, res.stderr  # SIGKILL: no finally, no rollback
    assert snapshot(proj) != before  # one file landed
    assert (proj / "sandbox" / "meta" / tid / "applying.json").exists()
    assert record(proj, tid)["status"] == "needs_review"
    res2 = fila(proj, "reject", tid, "--reason", "changed my mind")
    assert res2.exit_code == 4 and "fila apply ID" in res2.stderr
    res3 = fila(proj, "apply", tid, "--yes")
    assert res3.exit_code == 0, res3.output
    assert "interrupted" in res3.stdout
    assert_targets_hold_exactly_work(proj, tid, ("greeting.txt", "src/"))
    assert record(proj, tid)["status"] == "applied"
    assert "apply resumed" in [e["event"] for e in events(proj, tid)]


@docker
def test_a_crash_before_anything_landed_still_allows_reject(
    proj: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    before = snapshot(proj)

    def die(*a: object, **kw: object) -> None:  # the marker is written, then the process dies
        raise SystemExit("simulated crash")

    monkeypatch.setattr(landing, "land", die)
    with pytest.raises(SystemExit):
        apply_mod.apply(Root.at(proj), tid, by="bob")
    monkeypatch.undo()
    assert (proj / "sandbox" / "meta" / tid / "applying.json").exists()
    assert snapshot(proj) == before
    res = fila(proj, "reject", tid, "--reason", "no")
    assert res.exit_code == 0, res.output
    assert record(proj, tid)["status"] == "rejected"


# -- decisions ---------------------------------------------------------------------------------


@docker
def test_decisions_are_recorded_once(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    res = fila(proj, "apply", tid, "--yes", env={"FILA_USER": "carol"})
    assert res.exit_code == 0, res.output
    assert record(proj, tid)["decision"]["by"] == "carol"
    again = fila(proj, "apply", tid, "--yes")
    assert again.exit_code == 4 and "already applied by carol" in again.stderr
    rej = fila(proj, "reject", tid, "--reason", "too late")
    assert rej.exit_code == 4 and "already applied" in rej.stderr
    assert [e["event"] for e in events(proj, tid)].count("applied") == 1
    assert (proj / "greeting.txt").read_text() == "world\n"

    tid2 = run_shell(proj, "echo again > greeting.txt")
    res = fila(proj, "reject", tid2, "--reason", "wrong approach", "--by", "dave", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["decision"]
    assert d["action"] == "rejected" and d["by"] == "dave" and d["reason"] == "wrong approach"
    assert fila(proj, "apply", tid2, "--yes").exit_code == 4
    assert fila(proj, "reject", tid2).exit_code == 4
    assert (proj / "greeting.txt").read_text() == "world\n"
    rejected = [e for e in events(proj, tid2) if e["event"] == "rejected"]
    assert len(rejected) == 1 and rejected[0]["decision"]["reason"] == "wrong approach"


@docker
def test_a_failed_task_can_be_rejected_but_not_applied(proj: Path) -> None:
    tid = run_shell(proj, "echo partial > greeting.txt; exit 3", status="failed")
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4 and "only a task in needs_review" in res.stderr
    assert (proj / "greeting.txt").read_text() == "hello\n"
    assert fila(proj, "reject", tid, "-m", "engine failed").exit_code == 0
    assert record(proj, tid)["status"] == "rejected"


@docker
def test_two_people_applying_at_once_only_one_wins(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    results: list[object] = []

    def go(who: str) -> None:
        try:
            results.append(apply_mod.apply(Root.at(proj), tid, by=who).record.decision)
        except InvalidTransition as e:
            results.append(e)

    threads = [threading.Thread(target=go, args=(f"p{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wins = [r for r in results if not isinstance(r, InvalidTransition)]
    assert len(wins) == 1 and len(results) == 4
    assert [e["event"] for e in events(proj, tid)].count("apply started") == 1


@docker
def test_apply_without_a_terminal_needs_yes(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    res = fila(proj, "apply", tid)
    assert res.exit_code == 2 and "--yes" in res.stderr
    assert (proj / "greeting.txt").read_text() == "hello\n"


def test_unknown_task_is_not_found(tmp_path: Path) -> None:
    make_root(tmp_path)
    assert fila(tmp_path, "apply", "nope", "--yes").exit_code == 5
    assert fila(tmp_path, "reject", "nope").exit_code == 5
    assert fila(tmp_path, "review", "nope").exit_code == 5


# -- gc ----------------------------------------------------------------------------------------


@docker
def test_gc_removes_only_decided_jobs(proj: Path) -> None:
    applied = run_shell(proj, "echo world > greeting.txt")
    assert fila(proj, "apply", applied, "--yes").exit_code == 0
    rejected = run_shell(proj, "echo x > greeting.txt")
    assert fila(proj, "reject", rejected).exit_code == 0
    pending = run_shell(proj, "echo y > greeting.txt")
    jobs = proj / "sandbox" / "jobs"
    # An engine may leave a directory without permissions; gc must still remove it.
    (jobs / rejected / "work" / "locked").mkdir()
    (jobs / rejected / "work" / "locked").chmod(0)

    res = fila(proj, "gc", "--older-than", "14d")
    assert res.exit_code == 0 and "removed 0" in res.stdout
    res = fila(proj, "gc", "--older-than", "0s", "--dry-run", "--json")
    assert {c["id"] for c in json.loads(res.stdout)} == {applied, rejected}
    assert (jobs / applied).exists()
    res = fila(proj, "gc", "--older-than", "0s")
    assert res.exit_code == 0, res.output
    assert not (jobs / applied).exists() and not (jobs / rejected).exists()
    assert not (proj / "sandbox" / "meta" / applied).exists()
    assert (jobs / pending / "DIFF.patch").exists()
    assert record(proj, applied)["status"] == "applied"  # the record stays
    res = fila(proj, "review", applied)
    assert res.exit_code == 0 and "removed the decided job's directory" in res.stdout
    assert fila(proj, "gc", "--older-than", "2w").exit_code == 2
