"""`fila review`: what a person reads before deciding, built from DIFF.patch (the bytes apply
lands), after checking its sha256 against the record.

Everything shown comes from the engine one way or another (file names, contents, the log), so
every line is made inert before it reaches a terminal or a browser: control and format characters
(escape sequences, bidi overrides, zero-width characters) and bytes that are not UTF-8 are shown
as \\x1b, \\u202e, \\xff. The review also says what deserves a second look: sensitive paths,
new executables, symlinks and binaries, a patch over the policy's size limit, and any path apply
would refuse.
"""

from __future__ import annotations

import contextlib
import fnmatch
import html
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import fsutil
from ..core.errors import FilaError, NotFound
from ..core.layout import Root
from ..core.models import EgressRecord, Policy, Record, Status, now_iso
from ..egress import config as egress
from ..provenance.sources import FileSource, Source
from ..workspace import jobdir
from ..workspace.fswalk import escape_name, inert
from . import patch

if TYPE_CHECKING:
    from ..provenance.verify import Verdict

LOG_TAIL_BYTES = 32 << 10
_CI_DIRS = {".github", ".gitlab", ".circleci", ".buildkite", ".woodpecker", ".ci", ".azure-pipelines"}
_CI_FILES = {
    ".gitlab-ci.yml",
    "Jenkinsfile",
    ".travis.yml",
    "azure-pipelines.yml",
    ".drone.yml",
    "bitbucket-pipelines.yml",
    "appveyor.yml",
    "cloudbuild.yaml",
    ".pre-commit-config.yaml",
}
_LOCKS = {
    "package-lock.json",
    "npm-shrinkwrap.json",
    "yarn.lock",
    "pnpm-lock.yaml",
    "bun.lockb",
    "poetry.lock",
    "Pipfile.lock",
    "uv.lock",
    "pdm.lock",
    "Cargo.lock",
    "Gemfile.lock",
    "go.sum",
    "composer.lock",
    "mix.lock",
    "pubspec.lock",
    "packages.lock.json",
    "flake.lock",
    "gradle.lockfile",
}
_BUILD = {
    "Makefile",
    "GNUmakefile",
    "makefile",
    "CMakeLists.txt",
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "package.json",
    "build.gradle",
    "build.gradle.kts",
    "settings.gradle",
    "settings.gradle.kts",
    "pom.xml",
    "build.rs",
    "build.sh",
    "build.xml",
    "meson.build",
    "BUILD",
    "BUILD.bazel",
    "WORKSPACE",
    "MODULE.bazel",
    "configure",
    "Rakefile",
    "Justfile",
    "justfile",
    "Taskfile.yml",
    "tox.ini",
    "noxfile.py",
    "conftest.py",
    "Dockerfile",
    "Containerfile",
    "docker-compose.yml",
    "compose.yaml",
    "go.mod",
    "Gemfile",
    "requirements.txt",
    "Pipfile",
    "MANIFEST.in",
}
_BUILD_GLOBS = ("*.mk", "*.gradle", "*.cmake", "Dockerfile.*", "*.dockerfile", "requirements*.txt")
_ANSI = {
    "file": "\033[1m",
    "meta": "\033[1m",
    "hunk": "\033[36m",
    "add": "\033[32m",
    "del": "\033[31m",
    "binary": "\033[35m",
    "nonl": "\033[2m",
    "warn": "\033[33m",
}
_RESET = "\033[0m"


@dataclass
class Review:
    record: Record
    policy: Policy
    data: bytes | None = None  # None: the task has no DIFF.patch
    patch: patch.Patch | None = None
    parse_error: str | None = None
    warnings: list[str] = field(default_factory=list)
    project: str = ""  # where apply writes: shown first, escaped
    provenance: Verdict | None = None  # the statements checked (docs/provenance.md); None: not asked
    provenance_error: str | None = None  # why they could not be checked at all


def with_provenance(rv: Review, source: Source) -> Review:
    """`rv` with its task's statements checked against `source` (its queue)."""
    from . import attested

    try:
        rv.provenance = attested.verdict(source, rv.record, rv.data)
    except FilaError as e:
        rv.provenance_error = e.message
    return rv


def project_path(root: Root, rec: Record) -> str:
    """The directory apply would write to: the manifest's (what the job copied from and apply
    uses), or for a task that never ran, the one it names (relative to the queue root)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(jobdir.read_manifest(root, rec.id)["project"])
    named = rec.task.project if rec.task and rec.task.project else None
    return str(root.path / named) if named else str(root.path)


def load(root: Root, task_id: str) -> Review:
    """The record, the verified patch and the warnings. Raises ApplyRefused when DIFF.patch does
    not match the record's sha256: nobody should review bytes other than those recorded."""
    from ..queue import store as queue

    root.require()
    rec = queue.get_record(root, task_id)
    policy = patch.policy_for(root, rec)
    data, gone = None, []
    if rec.patch_path and rec.patch_sha256:
        try:
            data = patch.read_reviewed(root, rec, policy)
        except NotFound:
            if rec.status not in (Status.applied, Status.rejected):
                raise
            gone.append("DIFF.patch is gone: `fila gc` removed the decided job's directory")
    note = patch.policy_note(root, rec)
    rv = of(rec, policy, data, project_path(root, rec), root=root, notes=[*gone, *([note] if note else [])])
    return with_provenance(rv, FileSource(root))


def of(rec: Record, policy: Policy, data: bytes | None, project: str, *, root: Root | None,
       notes: list[str] | None = None, project_dir: Path | None = None) -> Review:  # fmt: skip
    """The review of `rec` with its patch `data` (verified by the caller against the record's
    sha256; None: no DIFF.patch): from the file queue's job directory (`load`: the project is
    the job's manifest's) or from a PostgreSQL queue's blobs (review/remote.review_queued: the
    project is `project_dir`, the reviewer's root, where `apply --queue` lands; None when there
    is none, and then no path is judged against fila's reserved directories)."""
    rv = Review(record=rec, policy=policy, data=data, project=project)
    if rv.data is not None:
        try:
            rv.patch = patch.parse(rv.data)
        except patch.PatchError as e:
            rv.parse_error = str(e)
    rv.warnings = _warnings(root, rv, project_dir) + list(notes or [])
    return rv


def category(path: str) -> str | None:
    """Why a path deserves a second look, or None."""
    parts = path.split("/")
    name = parts[-1]
    if name in _CI_FILES or any(p in _CI_DIRS for p in parts[:-1]):
        return "CI config"
    if name in _LOCKS or name.endswith(".lock"):
        return "lockfile"
    if name in _BUILD or any(fnmatch.fnmatchcase(name, g) for g in _BUILD_GLOBS):
        return "build script"
    if name in (".gitattributes", ".gitmodules", ".gitignore"):
        return "git configuration"
    if any(p.startswith(".") for p in parts):
        return "dotfile"
    return None


# A name that ends like the kind a review shows after it ("x.txt (deleted)").
_KIND_SUFFIX = re.compile(r" \((new|deleted|modified|mode[^)]*)\)$")


def misleading(path: str) -> str | None:
    """Why a file name may read as another one in a review, or None: a part that begins or ends
    with a space (HTML and many terminals hide it), letters beyond ASCII (a Cyrillic `а` looks
    like a Latin `a`), or an ending that reads as the file's kind."""
    parts = path.split("/")
    if any(p != p.strip(" ") for p in parts):
        return "a part begins or ends with a space"
    if not path.isascii() and any(c.isalpha() and not c.isascii() for c in path):
        return "letters beyond ASCII, which may look like others"
    if _KIND_SUFFIX.search(path):
        return "it ends like a file's kind"
    return None


def _warnings(root: Root | None, rv: Review, project_dir: Path | None = None) -> list[str]:
    rec, out = rv.record, []
    if rec.status != Status.needs_review:
        d = rec.decision
        out.append(f"status {rec.status}" + (f" ({d.action} by {inert(d.by)} at {d.at})" if d else "")
                   + ": this diff cannot be applied")  # fmt: skip
    if rv.parse_error:
        out.append(f"DIFF.patch is not a patch fila writes ({inert(rv.parse_error)}); "
                   "apply will refuse it")  # fmt: skip
    if rv.data is not None and len(rv.data) > rv.policy.max_diff_bytes:
        out.append(f"the patch is {len(rv.data)} bytes, above the policy's max_diff_bytes "
                   f"({rv.policy.max_diff_bytes})")  # fmt: skip
    reserved, policies = [], None
    project = project_dir
    try:
        if project is None and root is not None:
            project = Path(jobdir.read_manifest(root, rec.id)["project"])
    except (OSError, ValueError, KeyError):
        project = None
    if project is not None and root is not None:
        rel = {}
        for key, d in (("fila", root.fila), ("sandbox", root.path / "sandbox"),
                       ("policies", root.policies_dir)):  # fmt: skip
            with contextlib.suppress(ValueError):
                rel[key] = d.relative_to(project).as_posix()
        reserved = list(rel.values())  # apply refuses these, policies/ included
        policies = rel.get("policies")
    for f in rv.patch.files if rv.patch else []:
        name = escape_name(f.path)
        why = patch.unsafe_path(f.path, deny=rv.policy.deny, reserved=reserved)
        if why:
            out.append(f"apply will refuse {name}: {why}")
        cat = category(f.path)
        if policies is not None and f.path.startswith(policies + "/"):
            cat = "fila policy"
        if cat:
            out.append(f"sensitive path ({cat}): {name}")
        odd = misleading(f.path)
        if odd:
            out.append(f'a file name that may mislead ({odd}): "{name}"')
        if f.new_mode == "100755" and f.old_mode != "100755":
            out.append(f"adds an executable: {name}" if f.kind == "new"
                       else f"makes {name} executable")  # fmt: skip
        if f.new_mode == "120000":
            target = f.link_target
            shown = f" -> {inert(target)}" if target is not None else ""
            escapes = patch.link_escapes(f.path, target, reserved=reserved) if target is not None else None
            out.append(f"{'adds' if f.kind == 'new' else 'changes'} a symlink: {name}{shown}"
                       + (f" ({escapes}; apply will refuse it)" if escapes else ""))  # fmt: skip
        if f.binary:
            out.append(f"binary file: {name}")
    if rv.patch:
        exists = (lambda rel: os.path.lexists(project / rel)) if project is not None else None
        for d in patch.git_repositories(rv.patch, exists):
            out.append(f"looks like a git repository (HEAD, objects/, refs/): {escape_name(d)}/ "
                       f"(git would run what its config names); apply refuses it unless "
                       f"{patch.ALLOW_GIT_METADATA}")  # fmt: skip
    out += [inert(w) for w in rec.warnings]
    return list(dict.fromkeys(out))


# -- the terminal view ---------------------------------------------------------------------------


def summary_lines(rv: Review) -> list[str]:
    rec = rv.record
    model = f" (model {inert(rec.model)})" if rec.model else ""
    lines = [
        f"task      {inert(rec.id)}  ({rec.status})",
        f"project   {escape_name(rv.project)}",
        f"engine    {inert(rec.engine or '-')}{model}",
    ]
    if rec.image:
        lines.append(f"image     {inert(rec.image.tag)} {rec.image.id or ''}".rstrip())
    if rec.policy:
        lines.append(f"policy    {inert(rec.policy.name)} sha256:{inert(rec.policy.sha256[:12])}")
    if rec.backend:
        lines.append(f"backend   {inert(rec.backend)}")
    if rec.waived:  # the policy let the backend run without these: a reviewer must see it
        lines.append(f"WAIVED    {', '.join(inert(w) for w in rec.waived)} limits not enforced on this host")
    if rec.timings:
        lines.append("timings   " + ", ".join(f"{k} {v:.2f}s" for k, v in rec.timings.items()))
    lines += attempt_lines(rec, "attempt", 10)
    lines += environment_lines(rec, "env", 10)
    if rec.check:
        c = rec.check
        lines.append(
            f"check     {'passed' if c.passed else 'FAILED'} (exit {c.exit_code}): {inert(c.command)}"
        )
    if rec.error:
        lines.append(f"error     {rec.error.kind}: {inert(rec.error.message)}")
    if rv.data is None:
        lines.append("diff      none")
    else:
        files = rv.patch.files if rv.patch else []
        add, dele = sum(f.added for f in files), sum(f.deleted for f in files)
        binary = sum(f.binary for f in files)
        n = len(rv.patch.paths()) if rv.patch else "?"
        lines.append(f"diff      {n} file{'' if n == 1 else 's'}, +{add} -{dele}"
                     + (f", {binary} binary" if binary else "")
                     + f", {len(rv.data)} bytes, sha256 {rec.patch_sha256} (verified)")  # fmt: skip
        for f in files:
            lines.append(f"          {_file_kind(f):<9} {escape_name(f.path)}"
                         + ("" if f.binary else f"  +{f.added} -{f.deleted}"))  # fmt: skip
    if rec.decision:
        d = rec.decision
        lines.append(f"decision  {d.action} by {inert(d.by)} at {d.at}"
                     + (f": {inert(d.reason)}" if d.reason else ""))  # fmt: skip
    if rv.provenance is not None:
        lines.append(f"provenance {inert(rv.provenance.summary())}")
    elif rv.provenance_error is not None:
        lines.append(f"provenance cannot be checked: {inert(rv.provenance_error)}")
    return lines


def environment_lines(rec: Record, label: str, width: int) -> list[str]:
    """The project environment the task ran in (docs/environments.md, "In the record"): where it
    was declared, its key, built or cached and how long the setup took, its image, the paths it
    provides, what its setup's gateway saw and what reading the declaration warned of."""
    e = rec.environment
    if e is None:
        return []
    pad = " " * width
    name = f"{inert(e.name)} " if e.name else ""
    how = f"built in {e.setup_s:g} s" if e.how == "built" and e.setup_s is not None else e.how
    out = [f"{label:<{width}}{name}({escape_name(e.source)}, {e.form}) key {e.key[:12]}: {how}"]
    if e.pinned is not None:
        agree = "this content" if e.pinned == e.digest else f"content {e.pinned[:12]}, not made here"
        out.append(f"{pad}submitted for {agree}")
    if e.image is not None:
        out.append(f"{pad}image {inert(e.image.tag)} {e.image.id or ''}".rstrip())
    if e.provided:
        out.append(f"{pad}provides (read-only, not diffed): {', '.join(escape_name(p) for p in e.provided)}")
    if e.build_egress is not None:
        out.append(f"{pad}Dockerfile build {_egress_summary(e.build_egress)}")
    if e.egress is not None:
        out.append(f"{pad}setup {_egress_summary(e.egress)}")
    if e.log_path:
        out.append(f"{pad}setup log {escape_name(e.log_path)}")
    out += [f"{pad}warning: {inert(w)}" for w in e.warnings]
    return out


def attempt_lines(rec: Record, label: str, width: int) -> list[str]:
    """Each attempt of the record (every engine a run tried, the fallbacks too), numbered, with its
    outcome, engine time, exit code, why fila cut it short, its image, log and egress summary:
    `label` starts the first line, padded to `width`; the other lines are indented as far. A record
    of one attempt gets its first line only (the rest is the record's own)."""
    out: list[str] = []
    runs = {a.run for a in rec.attempts}
    for i, a in enumerate(rec.attempts):
        what = a.outcome or ("running" if rec.status == Status.running else "-")
        if a.error is not None and a.error.kind != what:
            what += f" ({a.error.kind})"
        if a.duration_s is not None:
            what += f", {a.duration_s:g} s"
        if a.exit_code is not None:
            what += f", exit {a.exit_code}"
        run = f" (run {a.run})" if a.run is not None and len(runs) > 1 else ""
        out.append(f"{label if i == 0 else '':<{width}}{a.number} {inert(a.engine)}{run}: {what}")
        pad = " " * (width + 2)
        if a.cut_short:
            out.append(f"{pad}{inert(a.cut_short)}")
        if len(rec.attempts) == 1:
            continue
        if a.image is not None:
            out.append(f"{pad}image {inert(a.image.tag)} {a.image.id or ''}".rstrip())
        if a.log_path:
            out.append(f"{pad}log {escape_name(a.log_path)}")
        if a.egress is not None:
            out.append(f"{pad}{_egress_summary(a.egress)}")
    return out


def _egress_summary(rec: EgressRecord) -> str:
    """What an attempt's gateway saw, in one line: the totals and each route's statuses."""
    routes = "".join(
        f"; {inert(name)} {s.requests} requests ("
        + ", ".join(f"{inert(k)}: {v}" for k, v in sorted(s.statuses.items()))
        + f"), {s.input_tokens} input / {s.output_tokens} output tokens"
        for name, s in sorted(rec.routes.items())
    )
    budget = f"; budget {inert(rec.budget_exhausted)} exhausted" if rec.budget_exhausted else ""
    learning = f"; LEARNING, learned {inert(egress.learned_text(rec))}" if rec.learning else ""
    return f"egress {rec.allowed} allowed, {rec.denied} denied{routes}{budget}{learning}"


def _file_kind(f: patch.FilePatch) -> str:
    if f.kind == "mode":
        return f"mode {f.new_mode[-3:]}" if f.new_mode else "mode"
    return {"new": "new", "deleted": "deleted", "modified": "modified"}[f.kind]


def render_text(rv: Review, *, color: bool) -> str:
    def paint(kind: str, text: str) -> str:
        return f"{_ANSI[kind]}{text}{_RESET}" if color and kind in _ANSI else text

    out = summary_lines(rv) + egress.lines(rv.record.egress)
    if rv.warnings:
        out.append(paint("warn", f"warnings  {len(rv.warnings)}"))
        out += [paint("warn", f"  ! {w}") for w in rv.warnings]
    if rv.data:
        out.append("")
        lines = patch.split_lines(rv.data)
        kinds = rv.patch.line_kinds if rv.patch else [_guess(line) for line in lines]
        out += [paint(k, inert(line)) for k, line in zip(kinds, lines, strict=True)]
    return "\n".join(out) + "\n"


def _guess(line: bytes) -> str:
    """Line kinds of a patch the parser refused: by prefix only, good enough to read it."""
    for prefix, kind in ((b"diff --git", "file"), (b"@@", "hunk"), (b"+", "add"), (b"-", "del")):
        if line.startswith(prefix):
            return kind
    return "ctx" if line.startswith(b" ") else "meta"


def page(text: str, *, enabled: bool) -> None:
    """Through $PAGER (default `less`, with -R for colors) when enabled, else straight out."""
    if enabled:
        argv = shlex.split(os.environ.get("PAGER") or "less")
        env = dict(os.environ)
        env.setdefault("LESS", "FRX")  # quit if one screen, raw colors, keep the screen
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
            with contextlib.suppress(BrokenPipeError):
                assert proc.stdin is not None
                proc.stdin.write(text.encode("utf-8", "replace"))
                proc.stdin.close()
            proc.wait()
            return
        except OSError:
            pass  # no such pager: print instead
    sys.stdout.write(text)
    sys.stdout.flush()


def to_json(rv: Review) -> dict[str, Any]:
    files = rv.patch.files if rv.patch else []
    return {
        "id": rv.record.id, "status": rv.record.status, "project": escape_name(rv.project),
        "patch_path": rv.record.patch_path, "patch_sha256": rv.record.patch_sha256,
        "patch_bytes": len(rv.data) if rv.data is not None else None,
        "verified": rv.data is not None, "parse_error": rv.parse_error,
        "warnings": rv.warnings,
        "files": [{"path": escape_name(f.path), "kind": f.kind, "old_mode": f.old_mode,
                   "new_mode": f.new_mode, "added": f.added, "deleted": f.deleted,
                   "binary": f.binary} for f in files],
        "egress": rv.record.egress.model_dump(mode="json") if rv.record.egress else None,
        "record": rv.record.model_dump(mode="json"),
        "provenance": rv.provenance.to_json() if rv.provenance is not None
                      else {"state": "error", "problems": [rv.provenance_error]} if rv.provenance_error
                      else None,
    }  # fmt: skip


# -- REVIEW.html ---------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table.meta td{padding:.15em .8em .15em 0;vertical-align:top}table.meta td:first-child{color:#666}
ul.warn li{color:#8a4b00}.none{color:#666}
code,pre,.diff td{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace}
details{margin:.6em 0;border:1px solid #ddd;border-radius:4px}
summary{padding:.35em .6em;background:#f4f4f4;cursor:pointer;font-weight:600}
table.diff{border-collapse:collapse;width:100%}
.diff td{padding:0 .5em;white-space:pre-wrap;word-break:break-all;vertical-align:top}
.diff td.n{color:#999;text-align:right;width:3.5em;user-select:none;white-space:pre}
.add{background:#e6ffec}.del{background:#ffebe9}.hunk{background:#ddf4ff;color:#0550ae}
.meta td,.binary td{color:#666}.nonl td{color:#999;font-style:italic}
pre.log{background:#f6f8fa;padding:1em;overflow:auto;max-height:40em;white-space:pre-wrap}
"""


def _h(text: str) -> str:
    return html.escape(text, quote=True)


def render_html(rv: Review, log_tail: bytes) -> str:
    rec = rv.record
    title = f"fila review: task {rec.id}"
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # No external asset can load, and no script runs: the page holds engine-written text.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'\">",
        f"<title>{_h(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_h(title)}</h1>",
        '<table class="meta">',
    ]
    for line in summary_lines(rv):
        key, _, value = line.partition(" ")
        parts.append(f"<tr><td>{_h(key)}</td><td>{_h(value.strip())}</td></tr>")
    parts.append("</table>")
    parts.append(f"<h2>Warnings ({len(rv.warnings)})</h2>")
    parts.append('<ul class="warn">' + "".join(f"<li>{_h(w)}</li>" for w in rv.warnings) + "</ul>"
                 if rv.warnings else '<p class="none">none</p>')  # fmt: skip
    if rec.egress is not None:
        parts.append("<h2>Egress</h2>")
        parts.append(f'<pre class="log">{_h(chr(10).join(egress.lines(rec.egress)))}</pre>')
    parts.append("<h2>Diff</h2>")
    if rv.data:
        parts += _html_diff(rv)
    else:
        parts.append('<p class="none">no DIFF.patch</p>')
    parts.append(f"<h2>Log (last {LOG_TAIL_BYTES >> 10} KiB)</h2>")
    shown = "\n".join(inert(line) for line in log_tail.split(b"\n"))
    parts.append(f'<pre class="log">{_h(shown) or "(empty)"}</pre>')
    parts.append(f"<p class=\"none\">Written by fila at {now_iso()} from DIFF.patch sha256 "
                 f"{_h(rec.patch_sha256 or '-')}.</p></body></html>")  # fmt: skip
    return "\n".join(parts) + "\n"


@dataclass
class DiffRow:
    """One line of a patch as a reader sees it: its kind (file, meta, hunk, ctx, add, del,
    binary, nonl), its line numbers on each side ("" where it has none) and its text made inert."""

    kind: str
    old: str
    new: str
    text: str


@dataclass
class FileDiff:
    """One file's part of a patch: its label (escaped name and kind) and its rows after the header."""

    label: str
    rows: list[DiffRow] = field(default_factory=list)
    name: str = ""  # the escaped name alone (a page quotes it), and its kind
    kind: str = ""


def diff_files(rv: Review) -> list[FileDiff]:
    """The verified patch split by file, each line made inert (REVIEW.html and `fila serve` show
    these; the terminal view the same lines with colors). Lines before the first file header, in a
    patch the parser refused, go to a file with an empty label."""
    assert rv.data is not None
    lines = patch.split_lines(rv.data)
    kinds = rv.patch.line_kinds if rv.patch else [_guess(line) for line in lines]
    names = iter(rv.patch.files) if rv.patch else iter(())
    out: list[FileDiff] = []
    old = new = 0
    for kind, raw in zip(kinds, lines, strict=True):
        text = inert(raw)
        if kind == "file":
            f = next(names, None)
            if f is None:
                out.append(FileDiff(text))
            else:
                name, what = escape_name(f.path), _file_kind(f)
                out.append(FileDiff(f"{name} ({what})", name=name, kind=what))
            continue
        if not out:
            out.append(FileDiff(""))
        if kind == "hunk":
            nums = raw.split(b" ")
            with contextlib.suppress(ValueError, IndexError):
                old = int(nums[1][1:].split(b",")[0])
                new = int(nums[2][1:].split(b",")[0])
            out[-1].rows.append(DiffRow(kind, "", "", text))
            continue
        a = b = ""
        if kind == "ctx":
            a, b, old, new = str(old), str(new), old + 1, new + 1
        elif kind == "del":
            a, old = str(old), old + 1
        elif kind == "add":
            b, new = str(new), new + 1
        out[-1].rows.append(DiffRow(kind, a, b, text))
    return out


def _html_diff(rv: Review) -> list[str]:
    out: list[str] = []
    for f in diff_files(rv):
        if f.label:
            out.append(f'<details open><summary>{_h(f.label)}</summary><table class="diff">')
        else:
            out.append('<table class="diff">')
        for r in f.rows:
            out.append(f'<tr class="{r.kind}"><td class="n">{r.old}</td><td class="n">{r.new}</td>'
                       f"<td>{_h(r.text)}</td></tr>")  # fmt: skip
        out.append("</table></details>" if f.label else "</table>")
    return out


def log_tail(root: Root, rec: Record) -> bytes:
    return file_tail(root.path / rec.log_path) if rec.log_path else b""


def file_tail(path: Path) -> bytes:
    """The last LOG_TAIL_BYTES of the log at `path`; empty when there is none, or when its name
    is a link or anything but a file fila can read without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - LOG_TAIL_BYTES), os.SEEK_SET)
        return os.read(fd, LOG_TAIL_BYTES)
    finally:
        os.close(fd)


def write_html(root: Root, rv: Review) -> Path:
    """Write `sandbox/jobs/<id>/REVIEW.html` (one file, no external assets) and return its path.
    A rename replaces whatever is at that name; nothing there is written through."""
    job = root.job_dir(rv.record.id)
    job.mkdir(parents=True, exist_ok=True)
    return write_html_at(job / "REVIEW.html", rv, log_tail(root, rv.record))


def write_html_at(dest: Path, rv: Review, tail: bytes) -> Path:
    """REVIEW.html at `dest` (its directory made), with `tail` as the log's end: replaced by a
    rename, never written through."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(dest, render_html(rv, tail))
    return dest
