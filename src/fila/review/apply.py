"""`fila apply`: land in the project exactly what was reviewed, or nothing.

The recipe (each step refuses with the reason, and nothing is written before the last two):
 1. DIFF.patch is read once and its sha256 checked against the record (`patch.read_reviewed`).
    A patch in which fila replaced a known credential by its marker (`credentials_in_diff`) is
    refused unless the person allows it (--allow-credential); then the marker lands, never the
    credential, and step 5 checks those files against the sha256 the record keeps for them.
 2. It is parsed strictly (`patch.parse`) and every path checked: no absolute path, `..`, `.git`
    component, control character, fila's own directories or policy-denied path; modes 100644,
    100755 or 120000 only; nothing created below a path the patch makes a file or a symlink.
 3. The project is checked against the manifest fila wrote when it copied the targets (moved
    base): every copied file must be unchanged, and every path the patch creates absent; a
    touched path's parent in the project must not be a symlink. The touched paths' current
    contents are copied into a staging directory (`sandbox/meta/<id>/apply/before`).
 4. The touched paths' pristine copies (input/, checked against the manifest) are copied to
    `staging/after`, and `git apply` (no system, global or project configuration, attributes
    overridden, hooks off) applies the patch there: all or nothing, outside the project.
    `git apply --numstat` must name the same paths as our parser.
 5. `staging/after` must then equal work/ for every touched path (what the engine left is what
    was diffed, reviewed and lands), and hold nothing else; symlinks must stay in the project.
 6. With --3way, a touched path changed in the project since is merged (`git merge-file`, base
    from input/); a conflict, a binary or a deleted file refuses the whole apply.
 7. A durable marker (`sandbox/meta/<id>/applying.json`) lists every path with its state before
    and after. Files are then written by temp file + rename (deletions first), never through a
    symlink; any failure restores what was already written from `staging/before`.
 8. The decision is recorded (`applied`, by, at, reason); the marker and staging go. A decision
    refused there (decided meanwhile elsewhere: a PostgreSQL queue's other reviewer, another
    member of the group) takes the landing back from `staging/before` (landing.roll_back) and
    says so; the project is then as it was.

A crash during 7 or 8 (fault points `apply_after_write`, `apply_before_record`) leaves the
marker: `fila apply ID` again finds every path either as it was or as it should become, finishes
the landing and records the decision (`fila reject ID` is allowed only while nothing was written
yet). A path that is neither refuses, listing it. A rollback after a failure puts back content and
permission bits (not owner, xattrs or inode); a file written is owned by the person applying.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..core.errors import CredentialInDiff, FilaError, InvalidTransition
from ..core.faults import crash_point
from ..core.layout import Root
from ..core.models import Policy, Record
from ..workspace import jobdir, overlay, secretscan
from ..workspace.fswalk import escape_name, walk
from ..workspace.hardgit import Git, tail
from ..workspace.safedir import ABSENT, SafeDir, State
from . import attested, decision, landing, patch
from .landing import refuse

# On top of hardgit's (hooks, fsmonitor, attributes): how apply writes files.
_GIT_CONFIG = (
    "-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "core.symlinks=true",
    "-c", "core.filemode=true", "-c", "core.ignorecase=false", "-c", "core.protectNTFS=true",
    "-c", "core.protectHFS=true", "-c", "apply.whitespace=nowarn",
)  # fmt: skip
# Overrides whatever a .gitattributes in the staged files says (info/attributes wins over it):
# no end-of-line conversion, no filters, no ident expansion, no re-encoding.
_ATTRIBUTES = "* -text -eol -crlf -ident -filter -working-tree-encoding -whitespace\n"


class Landing(Protocol):
    """Where an apply lands other than the task's project, and what it does once the files are
    there, before the decision is recorded (a failure there takes the landing back and records
    nothing): review/branch.py."""

    project: Path

    def landed(self, rec: Record, by: str, reason: str | None, ops: list[landing.Op],
               run: bytes | None) -> str:  # fmt: skip
        """Act on the landed files (`ops`: each touched path and the state it now holds; `run`:
        the task's run statement as verified, None with provenance off); what to add to the
        decision's reason."""
        ...


@dataclass
class Applied:
    record: Record
    project: Path
    written: list[str] = field(default_factory=list)  # escaped names
    deleted: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    moved_untouched: list[str] = field(default_factory=list)  # --3way: changed, not in the patch
    resumed: bool = False
    superseded: list[str] = field(default_factory=list)  # the group's other members (review/groups.py)
    credential_markers: list[str] = field(default_factory=list)  # files landed with the marker
    undecided: list[str] = field(default_factory=list)  # members still queued or running
    provenance: str | None = None  # the decision statement signed, or why not (docs/provenance.md)
    attestations: list[str] = field(default_factory=list)  # the statements written (--attestations)


def apply(root: Root, task_id: str, *, by: str | None = None, reason: str | None = None,
          three_way: bool = False, allow_git_metadata: bool = False,
          allow_credential: bool = False, book: decision.Book = decision.FILE,
          into: Landing | None = None) -> Applied:  # fmt: skip
    """Apply a task's DIFF.patch to its project and record the decision (see the module doc).
    A member of a compare group is applied only if no other member was, and the others are then
    marked superseded, under the group's lock (two people cannot land two members).

    `book`: where the record is read and the decision written (decision.Book); the job directory
    and its manifest are always the root's (review/remote.py lays them out for a queue URL).
    `into`: land elsewhere than the manifest's project, and act before the decision is recorded
    (review/branch.py: a worktree of the project's git checkout, then a commit on a new branch)."""
    from . import groups as compare

    rec = book.get(root.require(), task_id)
    group = rec.task.group if rec.task else None
    if group is None:
        return _apply_one(root, task_id, by=by, reason=reason, three_way=three_way,
                          allow_git_metadata=allow_git_metadata,
                          allow_credential=allow_credential, book=book, into=into)  # fmt: skip
    if book is not decision.FILE:
        # A queue's group: its decision and supersedes are one database transaction (the book's);
        # the root's group lock keeps two members from landing in this one checkout at once.
        with compare.group_lock(root, group):
            return _apply_one(root, task_id, by=by, reason=reason, three_way=three_way,
                              allow_git_metadata=allow_git_metadata,
                              allow_credential=allow_credential, book=book, into=into)  # fmt: skip
    with compare.group_lock(root, group):
        compare.check_not_decided(root, rec)
        res = _apply_one(root, task_id, by=by, reason=reason, three_way=three_way,
                         allow_git_metadata=allow_git_metadata,
                         allow_credential=allow_credential, into=into)  # fmt: skip
        # After the winner's own lock is released: each member's lock is then taken alone.
        sup = compare.supersede_others(root, res.record, by=decision.decider(by))
    res.superseded, res.undecided = sup.done, sup.undecided
    return res


def _apply_one(root: Root, task_id: str, *, by: str | None, reason: str | None,
               three_way: bool, allow_git_metadata: bool, allow_credential: bool,
               book: decision.Book = decision.FILE, into: Landing | None = None) -> Applied:  # fmt: skip
    who, why = decision.decider(by), decision.check_reason(reason)
    book.get(root.require(), task_id)  # NotFound before any lock file is made
    with decision.lock(root, task_id):
        rec = book.get(root, task_id)
        decision.check_undecided(rec, "apply")
        policy = patch.policy_for(root, rec)
        data = patch.read_reviewed(root, rec, policy)
        run = attested.check_before_apply(book.source(root), rec, data)
        staging = root.meta(task_id) / "apply"
        marker = landing.read_marker(root, task_id)
        if marker is not None:
            if into is not None:
                raise refuse("an interrupted apply of this task is recorded", task_id,
                             hint=f"finish it first with `fila apply {task_id}`")  # fmt: skip
            return _resume(root, rec, marker, staging, who, why, book)
        _check_credentials(rec, allow_credential)
        try:
            pt = patch.parse(data)
        except patch.PatchError as e:
            raise refuse(f"DIFF.patch is not a patch fila writes: {e}", task_id) from None
        manifest = _manifest(root, task_id)
        project = into.project if into is not None else Path(manifest["project"])
        if staging.exists():
            shutil.rmtree(staging)  # a refused or crashed earlier attempt: no marker, nothing landed
        staging.mkdir(parents=True)
        try:
            with SafeDir(project) as proj:
                plan = _Plan(root, rec, pt, manifest, proj, staging, policy, data)
                plan.check_paths()
                plan.check_git_metadata(allow_git_metadata)
                plan.check_base(three_way)
                plan.stage()
                plan.verify_against_work(allow_credential)
                if three_way:
                    plan.merge()
                ops = plan.ops()
                landing.write_marker(root, task_id, rec.patch_sha256, project, ops, plan.merged)
                book.log(
                    root,
                    task_id,
                    "apply started",
                    by=who,
                    files=len(ops),
                    merged=plan.merged,
                    project=str(project),
                )
                written, deleted = landing.land(proj, ops, staging, task_id, root)
                crash_point("apply_before_record")
        except BaseException:
            if landing.read_marker(root, task_id) is None:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        if into is not None:
            try:
                note = into.landed(rec, who, why, ops, run)
                why = f"{why}; {note}" if why else note
            except BaseException:
                landing.roll_back(root, task_id)
                raise
        new = _decide(root, task_id, book, who, why)
        landing.clear(root, task_id)
        signed = attested.sign_decision(root, book.source(root), new, project=project, merged=plan.merged)
        return Applied(new, project, written, deleted, [escape_name(p) for p in plan.merged],
                       [escape_name(p) for p in plan.moved_untouched],
                       credential_markers=plan.markers, provenance=signed)  # fmt: skip


def _decide(root: Root, tid: str, book: decision.Book, who: str, why: str | None) -> Record:
    """Step 8: the decision, after the landing. Refused there (InvalidTransition: another
    reviewer decided meanwhile, another member of the group won, a reject from another host),
    the landing is taken back (landing.roll_back: the touched paths from their before-states,
    marker and staging dropped) and the refusal says so; nothing of the patch stays."""
    try:
        return book.decide(root, tid, "apply", by=who, reason=why, expect=decision.DECIDABLE["apply"])
    except InvalidTransition as e:
        raise rolled_back(root, tid, book, e, who) from None


def rolled_back(root: Root, tid: str, book: decision.Book, err: FilaError, who: str) -> FilaError:
    """`err` (a refused decision) after the landing of `tid` was taken back from this root's
    marker, its message naming the files put back; the same error type, so the same exit."""
    names = landing.roll_back(root, tid)
    if not names:
        return err
    book.log(root, tid, "apply rolled back", by=who, files=names, reason=err.message)
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return type(err)(
        f"rolled back {len(names)} file{'s' if len(names) != 1 else ''}: {shown}; {err.message}",
        hint="the project is as it was before this apply",
        task_id=err.task_id,
        path=err.path,
    )


def patch_git(where: Path) -> Git:
    """git for applying patches, as step 4 runs it: none of the host's or the project's
    configuration, attributes overridden, hooks off; its private state under `where`."""
    return Git(where, purpose="applying patches", config=_GIT_CONFIG, attributes=_ATTRIBUTES)


def _check_credentials(rec: Record, allowed: bool) -> None:
    """A diff that held a known credential is refused unless the person says so: the credential
    itself never lands (DIFF.patch holds the marker), but the file the engine wrote was meant to
    hold it, and what it was doing with a key deserves a look first."""
    found = rec.credentials_in_diff
    if found is None or allowed:
        return
    where = sorted(found.files) or ["(the patch text: a file name, or a line the project already had)"]
    raise CredentialInDiff(
        f"the engine's changes held a known credential ({secretscan.counted(found.counts)}); "
        f"DIFF.patch has {secretscan.marker('…').decode()} in its place, in:\n  " + "\n  ".join(where),
        task_id=rec.id,
        hint=f"nothing was written; see where with `fila review {rec.id}`, revoke the credential if "
        f"it may have left the machine, then reject the task (fila reject ID --reason ...) or "
        f"apply it with the marker in place of the credential ({secretscan.ALLOW_FLAG})",
    )


def _manifest(root: Root, task_id: str) -> dict[str, Any]:
    try:
        return jobdir.read_manifest(root, task_id)
    except (FileNotFoundError, ValueError):
        raise refuse("the job's manifest is missing or unreadable, so fila cannot tell whether "
                     "the project changed since the task ran", task_id,
                     path=root.meta(task_id) / "manifest.json") from None  # fmt: skip


def _reserved(root: Root, project: Path) -> list[str]:
    out = []
    for d in (root.fila, root.path / "sandbox", root.policies_dir):
        with contextlib.suppress(ValueError):
            out.append(d.relative_to(project).as_posix())
    return out


class _Plan:
    """Everything up to the first write in the project."""

    def __init__(self, root: Root, rec: Record, pt: patch.Patch, manifest: dict[str, Any],
                 proj: SafeDir, staging: Path, policy: Policy, data: bytes) -> None:  # fmt: skip
        self.root, self.rec, self.pt, self.proj, self.policy = root, rec, pt, proj, policy
        self.tid = rec.id
        self.staging, self.data = staging, data
        self.paths = pt.paths()
        self.entries = {e["path"]: State(e["kind"], e["mode"] if e["kind"] == "file" else 0,
                                         e["sha256"]) for e in manifest["entries"]}  # fmt: skip
        self.max = policy.max_work_bytes
        # The state each touched path has after the patch, from the patch alone (last section wins).
        self.post: dict[str, str] = {}
        for f in pt.files:
            self.post[f.path] = (
                "absent" if f.new_mode is None else ("symlink" if f.new_mode == "120000" else "file")
            )
        self.before: dict[str, State] = {}
        self.perm: dict[str, int] = {}
        self.after: dict[str, State] = {}
        self.moved: list[str] = []
        self.moved_untouched: list[str] = []
        self.merged: list[str] = []
        self.markers: list[str] = []  # escaped: files landing with a credential's marker

    # 2. the paths themselves
    def check_paths(self) -> None:
        reserved = _reserved(self.root, self.proj.root)
        bad = []
        for p in self.paths:
            why = patch.unsafe_path(p, deny=self.policy.deny, reserved=reserved)
            if why is None and self.post[p] != "absent":
                parts = p.split("/")
                for i in range(1, len(parts)):
                    anc = "/".join(parts[:i])
                    if self.post.get(anc) in ("file", "symlink"):
                        why = f"created below {escape_name(anc)}, which the patch makes a {self.post[anc]}"
            if why is None:
                why = self._project_parent(p)
            if why:
                bad.append(f"{p} ({why})")
        for f in self.pt.files:  # the staged result is checked too; this names the reason early
            why = (
                patch.link_escapes(f.path, f.link_target, reserved=_reserved(self.root, self.proj.root))
                if f.link_target is not None
                else None
            )
            if why:
                bad.append(f"{f.path} ({why}: {os.fsdecode(f.link_target or b'')})")
        if bad:
            raise refuse(
                "the patch touches paths fila never writes",
                self.tid,
                bad,
                hint="nothing was written; reject the task (fila reject ID --reason ...)",
            )

    def check_git_metadata(self, allowed: bool) -> None:
        """A directory the patch makes look like a git repository is refused unless the person
        says so: git run there later would obey its config (see patch.git_repositories)."""
        repos = patch.git_repositories(self.pt, lambda rel: self.proj.lstat(rel) is not None)
        if repos and not allowed:
            raise refuse(
                "the patch makes directories that look like git repositories (HEAD, objects/, refs/)",
                self.tid,
                [f"{d}/" for d in repos],
                hint=f"nothing was written; if you meant to add them, apply with "
                f"{patch.ALLOW_GIT_METADATA}; otherwise reject the task",
            )

    def _project_parent(self, p: str) -> str | None:
        parts = p.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            st = self.proj.lstat(anc)
            if st is None:
                return None
            if (st.st_mode & 0o170000) == 0o120000 and self.post.get(anc) != "absent":
                return f"{escape_name(anc)} is a symlink in the project"
        return None

    # 3. moved base
    def check_base(self, three_way: bool) -> None:
        before_dir = self.staging / "before"
        before_dir.mkdir()
        changed: list[str] = []
        with SafeDir(before_dir) as bdir:
            for p in self.paths:
                cur = self.proj.copy_to(p, bdir, max_bytes=self.max)
                self.before[p] = cur
                st = self.proj.lstat(p)
                if cur.kind == "file" and st is not None:
                    self.perm[p] = st.st_mode & 0o777
                want = self.entries.get(p, ABSENT)
                if cur == want or (want == ABSENT and cur.kind == "dir" and self._emptied(p)):
                    continue
                self.moved.append(p)
                changed.append(f"{p} ({_what(want, cur)})")
        touched = set(self.paths)
        for p, want in self.entries.items():
            if p in touched:
                continue
            cur = self.proj.state(p, max_bytes=self.max)
            if cur != want:
                self.moved_untouched.append(p)
                changed.append(f"{p} ({_what(want, cur)}; not touched by the patch)")
        if changed and not three_way:
            raise refuse(
                "the project changed since the task copied its files (moved base)", self.tid,
                changed, hint="nothing was written; run the task again on the current files, "
                "or use --3way to merge the patch into them")  # fmt: skip

    def _emptied(self, d: str) -> bool:
        """Does the patch delete something below `d` (so the directory may become a file)?"""
        return any(p.startswith(d + "/") and self.post[p] == "absent" for p in self.paths)

    # 4. the patch applied outside the project
    def stage(self) -> None:
        base, after = self.staging / "base", self.staging / "after"
        base.mkdir()
        bad = []
        ov = overlay.job_overlay(self.root, self.tid)  # the overlay strategy: input/ is the snapshot
        inp_dir = ov.lower if ov is not None else self.root.job_dir(self.tid) / "input"
        with SafeDir(inp_dir) as inp, SafeDir(base) as bdir:
            for p in self.paths:
                if p in self.entries and inp.copy_to(p, bdir, max_bytes=self.max) != self.entries[p]:
                    bad.append(p)
        if bad:
            raise refuse("the job's input/ no longer matches its manifest", self.tid, bad)
        shutil.copytree(base, after, symlinks=True)
        if not self.pt.files:
            return
        (self.staging / "DIFF.patch").write_bytes(self.data)
        git = Git(self.staging, purpose="applying patches", config=_GIT_CONFIG, attributes=_ATTRIBUTES)
        listed = git.run(["apply", "--numstat", "-z", "../DIFF.patch"], work_tree=after)
        names = _numstat_paths(listed.stdout)
        if names is None or set(names) != set(self.paths):
            raise refuse("git reads different paths in DIFF.patch than fila does", self.tid)
        res = git.run(["apply", "--whitespace=nowarn", "../DIFF.patch"], work_tree=after, check=False)
        if res.returncode != 0:
            raise refuse("the patch does not apply to the files the task started from: "
                         + tail(res.stderr), self.tid)  # fmt: skip

    # 5. what was reviewed is what lands
    def verify_against_work(self, allow_credential: bool = False) -> None:
        """The staged files equal work/'s, or for a file in which fila replaced a credential by its
        marker (only with allow_credential), the masked file whose sha256 the record keeps."""
        creds = self.rec.credentials_in_diff
        masked = creds.files if creds is not None and allow_credential else {}
        after = self.staging / "after"
        expect = {p for p in self.paths if self.post[p] != "absent"}
        found = set()
        for e in walk(after, max_files=self.policy.max_work_files, max_bytes=self.max):
            if e.kind in ("file", "symlink"):
                found.add(e.rel)
            elif e.kind != "dir":
                found.add(e.rel + " (not a file)")
        if found != expect:
            raise refuse("applying the patch left other files than it names", self.tid,
                         sorted(found ^ expect))  # fmt: skip
        diffs = []
        try:
            ov = overlay.job_overlay(self.root, self.tid)  # work/ read from its layers, no mount
            job_work = self.root.job_dir(self.tid) / "work"
            work: SafeDir | overlay.MergedView = overlay.MergedView(ov) if ov else SafeDir(job_work)
        except FilaError as e:
            raise refuse(f"the job's work/ cannot be read: {e}", self.tid) from None
        with work, SafeDir(after) as adir:
            for p in self.paths:
                got = adir.state(p, max_bytes=self.max)
                want = work.state(p, max_bytes=self.max)
                if escape_name(p) in masked and want.kind == got.kind:
                    want = State(want.kind, want.mode, masked[escape_name(p)])
                    self.markers.append(escape_name(p))
                if got != want:
                    diffs.append(p)
                if got.kind == "symlink":
                    reserved = _reserved(self.root, self.proj.root)
                    why = patch.link_escapes(
                        p, adir.readlink(p), reserved=reserved
                    ) or self._link_resolves_out(p, adir)
                    if why:
                        raise refuse(f"the patch makes a symlink that leaves the project: "
                                     f"{escape_name(p)} ({why})", self.tid)  # fmt: skip
                self.after[p] = got
        if diffs:
            raise refuse("the patched files differ from the job's work/ (the patch or work/ "
                         "changed after the review)", self.tid, diffs)  # fmt: skip

    def _link_resolves_out(self, p: str, adir: SafeDir) -> str | None:
        # Lexically inside, but through a symlink the project has now (e.g. `a -> /etc`)?
        target = os.fsdecode(adir.readlink(p))
        real = Path(os.path.realpath(self.proj.root / os.path.dirname(p) / target))
        project = Path(os.path.realpath(self.proj.root))
        if not real.is_relative_to(project):
            return "it resolves outside the project"
        for r in _reserved(self.root, self.proj.root):
            if real.is_relative_to(project / r):
                return f"it resolves into fila's own {r}/"
        return None

    # 6. --3way
    def merge(self) -> None:
        conflicts = []
        git = (
            Git(self.staging, purpose="applying patches", config=_GIT_CONFIG, attributes=_ATTRIBUTES)
            if self.moved
            else None
        )
        with SafeDir(self.staging / "after") as adir:
            for p in self.moved:
                base, ours, theirs = self.entries.get(p, ABSENT), self.before[p], self.after[p]
                if ours == theirs or (ours.kind in ("absent", "dir") and theirs.kind in ("absent", "dir")):
                    self.after[p] = ours  # the project already has the change
                    continue
                if not base.kind == ours.kind == theirs.kind == "file":
                    conflicts.append(f"{p} (changed in the project: {_what(base, ours)}; "
                                     f"by the task: {_what(base, theirs)})")  # fmt: skip
                    continue
                if theirs.mode != base.mode and ours.mode not in (base.mode, theirs.mode):
                    conflicts.append(f"{p} (both changed its mode)")
                    continue
                mode = theirs.mode if theirs.mode != base.mode else ours.mode
                files = [str(self.staging / d / p) for d in ("before", "base", "after")]
                if any(b"\0" in Path(f).read_bytes()[:8000] for f in files):
                    conflicts.append(f"{p} (binary: no line merge)")
                    continue
                assert git is not None
                res = git.run(["merge-file", "-p", "-L", "project", "-L", "base", "-L", "task",
                               *files], check=False)  # fmt: skip
                if res.returncode != 0:
                    n = res.returncode if 0 < res.returncode < 128 else "some"
                    conflicts.append(f"{p} ({n} conflicting hunks)")
                    continue
                sha = adir.put_file(p, iter([res.stdout]), mode)
                self.after[p] = State("file", mode, sha)
                self.merged.append(p)
        if conflicts:
            raise refuse("--3way: the patch conflicts with changes made in the project since",
                         self.tid, conflicts, hint="nothing was written; merge by hand from "
                         "`fila diff ID`, or run the task again on the current files")  # fmt: skip

    def ops(self) -> list[landing.Op]:
        out = []
        for p in self.paths:
            b, a = self.before[p], self.after[p]
            if b != a and not (b.kind in ("absent", "dir") and a.kind in ("absent", "dir")):
                out.append(landing.Op(p, b, a, self.perm.get(p)))
        return out


def _what(want: State, cur: State) -> str:
    if cur.kind == "other":
        return "now behind a symlink, or not a file, symlink or directory"
    if want.kind == "absent":
        return f"created: now a {cur.kind}" if cur.kind != "absent" else "absent"
    if cur.kind == "absent":
        return "deleted"
    if cur.kind != want.kind:
        return f"was a {want.kind}, now a {cur.kind}"
    if cur.sha256 == want.sha256 and cur.mode != want.mode:
        return f"mode {want.mode:o} -> {cur.mode:o}"
    return "content changed"


def _resume(root: Root, rec: Record, marker: dict[str, Any], staging: Path, who: str,
            why: str | None, book: decision.Book) -> Applied:  # fmt: skip
    """Finish an apply that was interrupted after its marker was written."""
    tid = rec.id
    if marker.get("patch_sha256") != rec.patch_sha256:
        raise refuse("an interrupted apply of another patch is recorded", tid,
                     path=landing.marker_path(root, tid))  # fmt: skip
    ops = [landing.Op.from_json(o) for o in marker["ops"]]
    project = Path(marker["project"])
    with SafeDir(staging / "after") as adir:
        for op in ops:
            if (
                op.after.kind in ("file", "symlink")
                and adir.state(op.path, max_bytes=landing.ANY_SIZE) != op.after
            ):
                raise refuse("the staged copy of an interrupted apply is damaged", tid, [op.path])
    with SafeDir(project) as proj:
        odd = [op.path for op in ops if landing.classify(proj, op) == "other"]
        if odd:
            raise refuse(
                "an interrupted apply left files that are neither as they were nor as the patch makes them",
                tid,
                odd,
                hint=f"inspect them; the intended contents are in {staging}/after",
            )
        book.log(root, tid, "apply resumed", by=who, files=len(ops))
        written, deleted = landing.land(proj, ops, staging, tid, root, resuming=True)
    new = _decide(root, tid, book, who, why)
    landing.clear(root, tid)
    merged = [escape_name(p) for p in marker.get("merged", [])]
    signed = attested.sign_decision(root, book.source(root), new, project=project,
                                    merged=marker.get("merged", []))  # fmt: skip
    return Applied(new, project, written, deleted, merged, [], resumed=True, provenance=signed)


# git, with nothing of the host's or the project's configuration ------------------------------


def _numstat_paths(raw: bytes) -> list[str] | None:
    """Paths from `git apply --numstat -z`; None when git saw a rename or copy."""
    out = []
    for rec in raw.split(b"\0"):
        if not rec:
            continue
        fields = rec.split(b"\t", 2)
        if len(fields) != 3 or not fields[2]:
            return None  # "A\tD\t" then old\0new\0: a rename
        out.append(os.fsdecode(fields[2]))
    return out
