"""DIFF.patch parsed strictly: which paths it touches, how, and whether touching them is safe.

`fila review` and `fila apply` both read the patch through this parser. It accepts exactly the
shape `diff.compute_diff` writes (git's format from `diff-tree -p --binary --full-index
--no-renames`) and refuses anything else: text before the first `diff --git`, renames and copies,
`Binary files ... differ` without data, a section whose a/ and b/ names differ, a path named twice
(except a type change: a deletion then a creation), modes other than 100644, 100755 and 120000.
A hostile patch is written by hand; refusing what fila never writes keeps git's reading of the
patch and ours the same (apply also cross-checks the paths against `git apply --numstat`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.errors import ApplyRefused, FilaError, NotFound
from ..core.layout import Root
from ..core.models import Policy, Record
from ..queue.policy import denied_by, load_policy
from ..workspace.fswalk import escape_name, read_file

MODES = {"100644", "100755", "120000"}
_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_INDEX = re.compile(rb"^index ([0-9a-f]{7,64})\.\.([0-9a-f]{7,64})(?: ([0-7]{6}))?$")
_UNSUPPORTED = (b"rename from ", b"rename to ", b"copy from ", b"copy to ", b"similarity index ",
                b"dissimilarity index ")  # fmt: skip
_ESCAPES = {ord("a"): 7, ord("b"): 8, ord("f"): 12, ord("n"): 10, ord("r"): 13, ord("t"): 9,
            ord("v"): 11, ord("\\"): 92, ord('"'): 34}  # fmt: skip
# Code points some filesystems ignore in names (HFS+): ".g\u200cit" would be ".git" there.
_IGNORABLE = {chr(c) for r in ((0x200C, 0x2010), (0x202A, 0x202F), (0x206A, 0x2070)) for c in range(*r)}
_IGNORABLE.add("\ufeff")


class PatchError(Exception):
    """The patch is not one fila wrote: the message says which line and why."""


@dataclass
class FilePatch:
    """One `diff --git` section. A type change (file <-> symlink) is two sections, one path."""

    path: str  # '/'-separated, without a/ or b/; os.fsdecode of the bytes (may hold surrogates)
    old_mode: str | None  # None: created by this section
    new_mode: str | None  # None: deleted by this section
    binary: bool = False
    added: int = 0
    deleted: int = 0
    link_target: bytes | None = None  # new side of a 120000 text section

    @property
    def kind(self) -> str:
        if self.old_mode is None:
            return "new"
        if self.new_mode is None:
            return "deleted"
        return "mode" if self.old_mode != self.new_mode else "modified"


@dataclass
class Patch:
    files: list[FilePatch] = field(default_factory=list)
    # One kind per line of the patch, for rendering: file, meta, hunk, add, del, ctx, nonl, binary.
    line_kinds: list[str] = field(default_factory=list)

    def paths(self) -> list[str]:
        """Touched paths, each once, in patch order."""
        return list(dict.fromkeys(f.path for f in self.files))


def split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def parse(data: bytes) -> Patch:
    """Parse a DIFF.patch. Raises PatchError naming the line that is not what fila writes."""
    lines = split_lines(data)
    out = Patch(line_kinds=["meta"] * len(lines))
    i, seen = 0, {}
    while i < len(lines):
        fp, i = _section(lines, i, out.line_kinds)
        prev = seen.get(fp.path)
        if prev is not None and not (prev.new_mode is None and fp.old_mode is None):
            raise PatchError(f"{escape_name(fp.path)} appears twice (only a type change may do that)")
        seen[fp.path] = fp
        out.files.append(fp)
    return out


def _section(lines: list[bytes], i: int, kinds: list[str]) -> tuple[FilePatch, int]:
    head = lines[i]
    if not head.startswith(b"diff --git "):
        raise PatchError(f"line {i + 1}: expected 'diff --git', found {_show(head)}")
    kinds[i] = "file"
    path = _git_line_path(head[len(b"diff --git ") :], i)
    old: str | None = None
    new: str | None = None
    index_mode: str | None = None
    created = deleted = False
    i += 1
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"old mode "):
            old = _mode(line[9:], i)
        elif line.startswith(b"new mode "):
            new = _mode(line[9:], i)
        elif line.startswith(b"new file mode "):
            new, created = _mode(line[14:], i), True
        elif line.startswith(b"deleted file mode "):
            old, deleted = _mode(line[18:], i), True
        elif line.startswith(b"index "):
            m = _INDEX.match(line)
            if not m:
                raise PatchError(f"line {i + 1}: malformed index line {_show(line)}")
            index_mode = _mode(m.group(3), i) if m.group(3) else None
        elif line.startswith(_UNSUPPORTED):
            raise PatchError(f"line {i + 1}: renames and copies are not in fila's patches")
        else:
            break
        i += 1
    if created and deleted:
        raise PatchError(f"line {i}: a section both creates and deletes {escape_name(path)}")
    if created:
        old = None
    elif deleted:
        new = None
    elif old is None and new is None:
        if index_mode is None:
            raise PatchError(f"line {i}: no mode for {escape_name(path)}")
        old = new = index_mode
    elif old is None or new is None:
        raise PatchError(f"line {i}: 'old mode' without 'new mode' (or the reverse)")
    elif (old == "120000") != (new == "120000"):
        raise PatchError(f"line {i}: a type change must be a deletion and a creation")
    fp = FilePatch(path=path, old_mode=old, new_mode=new)
    if i < len(lines) and lines[i].startswith(b"--- "):
        i = _text(lines, i, fp, kinds)
    elif i < len(lines) and lines[i] == b"GIT binary patch":
        i = _binary(lines, i, fp, kinds)
    elif i < len(lines) and not lines[i].startswith(b"diff --git "):
        raise PatchError(f"line {i + 1}: unexpected {_show(lines[i])}")
    return fp, i


def _text(lines: list[bytes], i: int, fp: FilePatch, kinds: list[str]) -> int:
    a = _name_line(lines[i], b"--- ", b"a/", i)
    if i + 1 >= len(lines) or not lines[i + 1].startswith(b"+++ "):
        raise PatchError(f"line {i + 2}: expected '+++'")
    b = _name_line(lines[i + 1], b"+++ ", b"b/", i + 1)
    if (a is None) != (fp.old_mode is None) or (b is None) != (fp.new_mode is None):
        raise PatchError(f"line {i + 1}: /dev/null disagrees with the file's mode lines")
    if any(n is not None and n != fp.path for n in (a, b)):
        raise PatchError(f"line {i + 1}: the ---/+++ names differ from the diff --git line")
    i += 2
    plus: list[bytes] = []
    if i >= len(lines) or not lines[i].startswith(b"@@"):
        raise PatchError(f"line {i + 1}: expected a hunk ('@@')")
    while i < len(lines) and lines[i].startswith(b"@@"):
        m = _HUNK.match(lines[i])
        if not m:
            raise PatchError(f"line {i + 1}: malformed hunk header {_show(lines[i])}")
        kinds[i] = "hunk"
        old_left = int(m.group(2)) if m.group(2) is not None else 1
        new_left = int(m.group(4)) if m.group(4) is not None else 1
        i += 1
        while old_left or new_left or (i < len(lines) and lines[i].startswith(b"\\")):
            if i >= len(lines):
                raise PatchError("the patch ends inside a hunk")
            line, c = lines[i], lines[i][:1]
            if c == b" " and old_left and new_left:
                old_left, new_left, kinds[i] = old_left - 1, new_left - 1, "ctx"
            elif c == b"-" and old_left:
                old_left, kinds[i] = old_left - 1, "del"
                fp.deleted += 1
            elif c == b"+" and new_left:
                new_left, kinds[i] = new_left - 1, "add"
                fp.added += 1
                plus.append(line[1:])
            elif c == b"\\" and i > 0 and kinds[i - 1] in ("ctx", "del", "add"):
                kinds[i] = "nonl"
            else:
                raise PatchError(f"line {i + 1}: does not fit the hunk's line counts")
            i += 1
    if fp.new_mode == "120000" and len(plus) == 1:
        fp.link_target = plus[0]
    return i


def _binary(lines: list[bytes], i: int, fp: FilePatch, kinds: list[str]) -> int:
    fp.binary = True
    kinds[i] = "binary"
    i += 1
    for block in range(2):  # forward data, then (as git writes it) the reverse
        if i >= len(lines) or not re.match(rb"^(literal|delta) \d+$", lines[i]):
            if block == 1:
                break
            raise PatchError(f"line {i + 1}: expected 'literal N' or 'delta N'")
        kinds[i] = "binary"
        i += 1
        while i < len(lines) and lines[i] != b"":
            if not re.match(rb"^[A-Za-z][0-9A-Za-z!#$%&()*+;<=>?@^_`{|}~-]+$", lines[i]):
                raise PatchError(f"line {i + 1}: not base85 binary data")
            kinds[i] = "binary"
            i += 1
        if i >= len(lines):
            raise PatchError("the patch ends inside binary data")
        kinds[i] = "binary"
        i += 1
    return i


def _mode(raw: bytes, i: int) -> str:
    mode = raw.decode("ascii", "replace")
    if mode not in MODES:
        raise PatchError(
            f"line {i + 1}: mode {_show(raw)} (only 100644, 100755 and 120000: no setuid, "
            "no device, no submodule)"
        )
    return mode


def _git_line_path(rest: bytes, i: int) -> str:
    """The one path of `diff --git a/P b/P` (names equal: fila's patches have no renames)."""
    if rest.startswith(b'"'):
        a, end = _unquote(rest, 0, i)
        if rest[end : end + 1] != b" ":
            raise PatchError(f"line {i + 1}: malformed diff --git line")
        if rest[end + 1 : end + 2] == b'"':
            b, end2 = _unquote(rest, end + 1, i)
            if end2 != len(rest):
                raise PatchError(f"line {i + 1}: text after the names")
        else:
            b = rest[end + 1 :]
    else:
        half = (len(rest) - 1) // 2
        a, b = rest[:half], rest[half + 1 :]
        if len(rest) % 2 == 0 or rest[half : half + 1] != b" ":
            raise PatchError(f"line {i + 1}: the a/ and b/ names differ (a rename?)")
    if not a.startswith(b"a/") or not b.startswith(b"b/") or a[2:] != b[2:]:
        raise PatchError(f"line {i + 1}: the a/ and b/ names differ (a rename?)")
    return os.fsdecode(a[2:])


def _name_line(line: bytes, lead: bytes, prefix: bytes, i: int) -> str | None:
    rest = line[len(lead) :]
    if rest == b"/dev/null":
        return None
    if rest.startswith(b'"'):
        name, end = _unquote(rest, 0, i)
        if rest[end:] not in (b"", b"\t"):
            raise PatchError(f"line {i + 1}: text after the name")
    else:
        name = rest[:-1] if rest.endswith(b"\t") else rest  # git adds a tab after a name with spaces
    if not name.startswith(prefix):
        raise PatchError(f"line {i + 1}: the name lacks the {prefix.decode()} prefix")
    return os.fsdecode(name[len(prefix) :])


def _unquote(s: bytes, start: int, i: int) -> tuple[bytes, int]:
    """git's C-style quoted name starting at s[start] == '"'; returns (bytes, index after)."""
    out = bytearray()
    j = start + 1
    while j < len(s):
        c = s[j]
        if c == ord('"'):
            return bytes(out), j + 1
        if c == ord("\\"):
            j += 1
            if j < len(s) and s[j] in _ESCAPES:
                out.append(_ESCAPES[s[j]])
                j += 1
            elif re.match(rb"[0-3][0-7]{2}", s[j : j + 3]):
                out.append(int(s[j : j + 3], 8))
                j += 3
            else:
                raise PatchError(f"line {i + 1}: bad escape in a quoted name")
        else:
            out.append(c)
            j += 1
    raise PatchError(f"line {i + 1}: unterminated quoted name")


def _show(raw: bytes) -> str:
    return repr(escape_name(os.fsdecode(raw[:80])))


# -- what a path may be ------------------------------------------------------------------------


def is_dotgit(component: str) -> bool:
    """Does this name mean `.git` to some filesystem (case, trailing dots or spaces, an NTFS
    stream, ignorable code points, the 8.3 short name)?"""
    n = "".join(c for c in component if c not in _IGNORABLE).lower()
    n = re.split(r"[:\\]", n, maxsplit=1)[0].rstrip(". ")
    return n in (".git", "git~1")


def unsafe_path(path: str, *, deny: list[str], reserved: list[str]) -> str | None:
    """Why apply must not write `path` (project-relative), or None when it may.

    `reserved` are project-relative prefixes fila itself owns (fila/, sandbox/ when the queue
    root is the project): a patch writing there could forge records or queue tasks.
    """
    if not path or path.startswith("/"):
        return "an absolute path"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "a path with '..', '.' or an empty component"
    if any(is_dotgit(p) for p in parts):
        return "a path inside .git/"
    if any(unicodedata.category(c) == "Cc" for c in path):
        return "a control character in the name"
    if any(path == r or path.startswith(r + "/") for r in reserved):
        return "a path in fila's own directories"
    rule = denied_by(path, False, deny)
    if rule is not None:
        return f"a path the policy denies ({rule!r})"
    return None


def link_escapes(path: str, target: bytes, *, reserved: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why a symlink at `path` pointing to `target` leads out of the project, or None.

    `reserved` are fila's own directories inside the project (fila/, sandbox/, policies/): a link
    into them would land engine-written, unreviewed files (e.g. sandbox/jobs/ID/payload.py)
    behind a reviewed name.
    """
    if not target:
        return "an empty symlink target"
    if target.startswith(b"/"):
        return "a symlink to an absolute path"
    where = posixpath.normpath(posixpath.join(posixpath.dirname(os.fsencode(path)), target))
    if where == b".." or where.startswith(b"../"):
        return "a symlink pointing outside the project"
    if any(is_dotgit(os.fsdecode(p)) for p in where.split(b"/")):
        return "a symlink into .git/"
    for r in reserved:
        rb = os.fsencode(r)
        if where == rb or where.startswith(rb + b"/"):
            return f"a symlink into fila's own {r}/"
    return None


# The flag that lets `fila apply` write a directory that looks like a git repository.
ALLOW_GIT_METADATA = "--allow-git-metadata"
# What makes git open a directory as a repository (setup.c, is_git_directory): a HEAD, and
# objects and refs it can access (any kind of entry: access(X_OK) follows a symlink and passes
# for an executable file), or a `commondir` file that points them elsewhere. A HEAD beside a
# `config` is flagged too: that config is what runs (core.fsmonitor, core.pager) once the rest
# is there, and no ordinary project keeps those two names side by side.
_GIT_LAYOUTS = (("head", "objects", "refs"), ("head", "commondir"), ("head", "config"))
_LEAF_MARKERS = frozenset({"head", "objects", "refs", "commondir", "config"})
_DIR_MARKERS = frozenset({"objects", "refs"})


def git_repositories(pt: Patch, exists: Callable[[str], bool] | None = None) -> list[str]:
    """Directories the patch leaves looking like a bare git repository (see _GIT_LAYOUTS;
    whatever the directory's name; '.' is the project root), sorted.

    git opens such a directory as a repository wherever a later `git` command runs in it or below,
    and runs what its config names (core.fsmonitor, hooks): engine-written code on the host.
    `.git` itself never gets here (unsafe_path refuses it outright). `exists(rel)` says whether the
    project already has a path, since the patch may add only the missing parts; names are
    compared case-insensitively, as a case-insensitive filesystem would open them.
    """
    present: dict[str, bool] = {}
    for f in pt.files:  # the last section of a path wins (a type change is two sections)
        present[f.path] = f.new_mode is not None
    found: dict[str, set[str]] = {}
    for path, there in present.items():
        if not there:
            continue
        parts = path.split("/")
        for i, name in enumerate(parts):
            marker = name.casefold()
            # A file or symlink of any marker's name; objects/ and refs/ also as a directory,
            # which shows as a path below them.
            last = i == len(parts) - 1
            if (last and marker in _LEAF_MARKERS) or (not last and marker in _DIR_MARKERS):
                found.setdefault("/".join(parts[:i]) or ".", set()).add(marker)
    out = []
    for d, markers in found.items():
        base = "" if d == "." else d + "/"

        def there(m: str, markers: set[str] = markers, base: str = base) -> bool:
            return m in markers or (exists is not None and any(exists(base + n) for n in (m, m.upper())))

        if any(all(there(m) for m in layout) for layout in _GIT_LAYOUTS):
            out.append(d)
    return sorted(out)


# -- the reviewed bytes ------------------------------------------------------------------------


def policy_for(root: Root, rec: Record) -> Policy:
    """The task's policy as it is now; the defaults when it cannot be loaded any more
    (policy_note says so for the review)."""
    try:
        return load_policy(root, _policy_name(rec))[0]
    except FilaError:
        return Policy(max_timeout_ms=1, default_timeout_ms=1)


def policy_note(root: Root, rec: Record) -> str | None:
    """The review's warning when this root cannot load the task's policy (a reviewer's root of a
    PostgreSQL queue that lacks it, or a policy removed since): its checks then use fila's
    built-in defaults (no deny list, the default limits), and the review names both. None when
    the task's own policy judges it."""
    name = _policy_name(rec)
    try:
        load_policy(root, name)
    except FilaError as e:
        return (f"policy {name!r} cannot be loaded from this root ({e.message}): the patch's paths "
                "were judged by fila's built-in defaults (no deny list), not by that policy")  # fmt: skip
    return None


def _policy_name(rec: Record) -> str:
    return rec.policy.name if rec.policy else (rec.task.policy if rec.task and rec.task.policy else "default")


def read_reviewed(root: Root, rec: Record, policy: Policy) -> bytes:
    """DIFF.patch as recorded, after checking its sha256 against the record's.

    Review and apply read the patch only through this function, so what a person read and what
    lands are the same bytes. A patch changed after the record (edited, regenerated) is refused.
    """
    expected = root.job_dir(rec.id) / "DIFF.patch"
    if not rec.patch_path or not rec.patch_sha256:
        raise NotFound(
            f"task {rec.id} has no DIFF.patch (status {rec.status})",
            task_id=rec.id,
            hint="`fila show ID` tells why; a failed task may have no diff",
        )
    if root.path / rec.patch_path != expected:
        raise ApplyRefused(
            f"the record names an unexpected patch path {rec.patch_path!r}", task_id=rec.id, path=expected
        )
    # A patch over the policy's limit is still read (review warns about it), up to a hard cap.
    cap = max(policy.max_diff_bytes, 1 << 30)
    if not os.path.lexists(expected):
        raise NotFound(
            "DIFF.patch is missing",
            task_id=rec.id,
            path=expected,
            hint="`fila gc` removes job directories of decided tasks only",
        )
    try:
        data = read_file(expected, max_bytes=cap)
    except FilaError as e:
        raise ApplyRefused(f"cannot read DIFF.patch: {e.message}", task_id=rec.id, path=expected) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != rec.patch_sha256:
        raise ApplyRefused(
            f"DIFF.patch does not match the sha256 in the record (recorded "
            f"{rec.patch_sha256[:16]}..., now {digest[:16]}...): it was changed after the task ran "
            "(tampered with or regenerated)",
            task_id=rec.id,
            path=expected,
            hint="nothing was written; run the task again (fila submit) to get a patch to review",
        )
    return data
