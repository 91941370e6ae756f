"""The review gate on the command line: what there is to decide (`fila ls`, `show`, `logs`, `diff`,
`review`, `compare`) and the decision (`fila apply`, `reject`).

Everything shown here comes from files an engine or a task's author wrote: text is escaped
(`safe`) on a terminal, and bytes go out unchanged only when piped (docs/architecture.md, threat
model).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core.states import Status
from .common import (
    ByOpt,
    JsonOpt,
    QueueOpt,
    ReasonOpt,
    RootOpt,
    print_json,
    record_json,
    safe,
    summary_line,
    to_stderr,
)

if TYPE_CHECKING:
    from ..api.client import Client


def ls_cmd(
    root: RootOpt = None,
    status: Annotated[Status | None, typer.Option(help="only tasks in this status")] = None,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """List tasks with their status, newest last (--queue: of that PostgreSQL queue)."""
    from ..api.client import Client

    with Client(root, queue=queue_url) as client:
        got = client.listing(status)
    recs, dropped, unreadable = got.records, got.dropped, got.unreadable
    if json_:
        print_json(
            [
                {
                    "id": x.id,
                    "status": x.status,
                    "engine": x.engine,
                    "submitted_at": x.submitted_at,
                    "error": x.error.kind if x.error else None,
                    "diffstat": x.diffstat.model_dump() if x.diffstat else None,
                }
                for x in recs
            ]
            + [{"id": d, "status": "queued", "engine": None} for d in dropped]
            + [{"id": i, "status": None, "engine": None, "unreadable": why} for i, why in unreadable]
        )
        return
    for x in recs:
        typer.echo(summary_line(x))
    for d in dropped:
        typer.echo(f"{safe(d)}  queued  (dropped in fila/in, not yet claimed)")
    for i, why in unreadable:
        typer.echo(f"{safe(i)}  unreadable  ({safe(why)})")


def show(task_id: str, root: RootOpt = None, json_: JsonOpt = False, queue_url: QueueOpt = None) -> None:
    """Show a task's record: status, engine, image, policy, timings, diffstat, error (--queue: from
    that PostgreSQL queue, its patch and log named by their blobs)."""
    from ..api.client import Client
    from ..review.report import attempt_lines, environment_lines
    from ..workspace.fswalk import escape_name

    with Client(root, queue=queue_url) as client:
        rec, blobs = client.record(task_id), client.blobs(task_id)
        project, r = client.project_of(rec), client.root
    if json_:
        print_json(record_json(rec))
        return
    lines = [
        f"id:        {rec.id}",
        f"project:   {escape_name(project)}",
        f"status:    {rec.status}",
        f"engine:    {rec.engine or '-'}" + (f" (model {rec.model})" if rec.model else ""),
    ]
    if rec.image:
        lines.append(f"image:     {rec.image.tag} {rec.image.id or ''}".rstrip())
    if rec.policy:
        lines.append(f"policy:    {rec.policy.name} sha256:{rec.policy.sha256[:12]}")
    lines.append(f"attempt:   {rec.attempt}")
    if rec.exit_code is not None:
        lines.append(f"exit code: {rec.exit_code}")
    lines += attempt_lines(rec, "attempts:", 11)  # each engine tried, fallbacks too
    lines += environment_lines(rec, "env:", 11)
    if rec.task and rec.task.submitter:
        lines.append(f"submitter: {rec.task.submitter}")
    if rec.task and rec.task.group:
        lines.append(f"group:     {rec.task.group} (`fila compare {rec.task.group}`)")
    if rec.check:
        c = rec.check
        lines.append(f"check:     {'passed' if c.passed else 'failed'} (exit {c.exit_code}): {c.command}")
    if rec.error:
        lines.append(f"error:     {rec.error.kind}: {rec.error.message}")
    if rec.diagnosis:
        lines.append(f"diagnosis: {rec.diagnosis}")
    if rec.timings:
        lines.append("timings:   " + ", ".join(f"{k} {v:.2f}s" for k, v in rec.timings.items()))
    if rec.diffstat:
        s = rec.diffstat
        lines.append(
            f"diff:      {s.files} files, +{s.insertions} -{s.deletions}"
            + (f", {s.binary} binary" if s.binary else "")
        )
        lines += [f"           {safe(p)}" for p in s.paths]
    if blobs is not None:
        for name in sorted(blobs):
            lines.append(f"blob:      {name} sha256 {blobs[name]}")
    else:
        if rec.patch_path:
            lines.append(f"patch:     {r.path / rec.patch_path} (sha256 {rec.patch_sha256})")
        if rec.log_path:
            lines.append(f"log:       {r.path / rec.log_path}")
    for w in rec.warnings:
        lines.append(f"warning:   {safe(w)}")
    from ..egress.record import lines as egress_lines

    lines += egress_lines(rec.egress)
    if rec.decision:
        d = rec.decision
        lines.append(f"decision:  {d.action} by {d.by} at {d.at}" + (f": {d.reason}" if d.reason else ""))
    # Each line escaped whole: id, model, image, policy, error, decision all come from files.
    typer.echo("\n".join(safe(line) for line in lines))


def logs(
    task_id: str,
    root: RootOpt = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing while the task is queued or running")
    ] = False,
    events: Annotated[bool, typer.Option("--events", help="the task's event log (JSON lines)")] = False,
    queue_url: QueueOpt = None,
) -> None:
    """Print a task's engine output (fila/logs/ID.log), or with --events its event log.

    On a terminal, control characters from the engine are shown escaped; piped, the bytes are
    written as they are. --follow is progress for long work: it ends when the task is decided.
    --queue: the log its runner published (a blob, checked against its sha256), or with --events
    the queue's events of the task; --follow is the file queue's only.
    """
    from ..api.client import Client

    tty = sys.stdout.isatty()
    with Client(root, queue=queue_url) as client:
        for data in client.log_chunks(task_id, events=events, follow=follow):
            if tty:
                from ..workspace.fswalk import inert

                typer.echo("\n".join(inert(x) for x in data.split(b"\n")), nl=False)
            else:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()


def diff(task_id: str, root: RootOpt = None, queue_url: QueueOpt = None) -> None:
    """Print the task's DIFF.patch, exactly as `fila apply` would apply it.

    The patch is checked against the sha256 in the record first. On a terminal, control
    characters are escaped (a hostile line could otherwise hide itself with escape sequences);
    piped, the bytes are written unchanged, e.g. for `git apply`. --queue: the patch is the
    task's DIFF.patch blob in that PostgreSQL queue, checked the same way.
    """
    from ..api.client import Client

    with Client(root, queue=queue_url) as client:
        got = client.patch(task_id)
    rec, data = got.record, got.data
    if rec.credentials_in_diff is not None:  # on stderr: the patch on stdout stays a patch
        from ..workspace.secretscan import diff_warning

        found = rec.credentials_in_diff
        to_stderr(f"fila: warning: {diff_warning(found.counts, len(found.files))}")
    if sys.stdout.isatty():
        from ..workspace.fswalk import inert

        typer.echo("\n".join(inert(line) for line in data.split(b"\n")), nl=False)
        return
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


def review(
    task_id: str,
    root: RootOpt = None,
    html: Annotated[
        bool,
        typer.Option(
            "--html",
            help="write a self-contained REVIEW.html in the job directory (--queue: at --out, else "
            "<root>/fila/reviews/ID/REVIEW.html); print its path",
        ),
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="with --html --queue: where REVIEW.html is written")
    ] = None,
    no_pager: Annotated[bool, typer.Option("--no-pager", help="print, do not page")] = False,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """Show what a decision is about: engine, model, policy, timings, files, warnings, and the
    diff, read from DIFF.patch after checking its sha256 (refused when it changed).

    Colors and the pager ($PAGER, default less -R) only on a terminal. Control characters in
    names and contents are shown escaped. --queue: a task of that PostgreSQL queue, its
    DIFF.patch blob checked against the sha256 its record names, judged by this root's policy.
    """
    import os

    from ..api.client import Client, check_review_out
    from ..review import report as rv

    check_review_out(out, html=html, queued=bool(queue_url))
    with Client(root, queue=queue_url) as client:
        if html:
            path = client.review_html(task_id, out)
        else:
            got, path = client.review(task_id), None
    if path is not None:
        if json_:
            print_json({"id": task_id, "html": str(path)})
        else:
            typer.echo(str(path))
        return
    if json_:
        print_json(rv.to_json(got))
        return
    tty = sys.stdout.isatty()
    text = rv.render_text(got, color=tty and "NO_COLOR" not in os.environ)
    rv.page(text, enabled=tty and not no_pager)


def apply_cmd(
    task_id: str,
    root: RootOpt = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="do not ask for confirmation (required without a terminal)")
    ] = False,
    three_way: Annotated[
        bool,
        typer.Option(
            "--3way",
            help="merge into files changed in the project since the task ran; "
            "refuses (writing nothing) on any conflict",
        ),
    ] = False,
    by: ByOpt = None,
    reason: Annotated[str | None, typer.Option(help="recorded with the decision")] = None,
    allow_git_metadata: Annotated[
        bool,
        typer.Option(
            "--allow-git-metadata",
            help="write directories that look like git repositories (HEAD, objects/, refs/); "
            "refused without it",
        ),
    ] = False,
    allow_credential: Annotated[
        bool,
        typer.Option(
            "--allow-credential",
            help="apply a diff in which fila replaced a known credential by its marker (the marker "
            "lands, never the credential); refused without it",
        ),
    ] = False,
    branch: Annotated[
        str | None,
        typer.Option(
            "--branch",
            help="land the patch as a commit on this new branch of the project's git checkout (HEAD its "
            "base); the checked-out branch and the working tree are not touched",
            show_default=False,
        ),
    ] = None,
    attestations: Annotated[
        Path | None,
        typer.Option(
            "--attestations",
            help="once applied, write the task's signed statements here (made if missing; not a "
            "symlink) as ID.run.intoto.json and ID.decision.intoto.json, to commit beside the change",
            show_default=False,
        ),
    ] = None,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """Apply the task's DIFF.patch to the project and record the decision (status applied).

    Refused, writing nothing, when DIFF.patch changed since the record, when the project changed
    since the task copied its files (unless --3way merges cleanly), when the patch does not
    apply as a whole, or when it touches a path fila never writes (outside the project, .git/,
    through a symlink). A directory the patch makes look like a git repository (HEAD, objects/,
    refs/) is refused unless --allow-git-metadata. A diff that held a credential fila knows (a
    route's key, an engine's secret; DIFF.patch has a marker in its place) is refused unless
    --allow-credential. What lands equals the job's work/ byte for byte, modes 0644/0755, but
    for that marker.

    --branch NAME: the same checks and decision, but the patch lands in a temporary worktree of
    the project's git checkout at HEAD and is committed there (no hook runs) on the new branch
    NAME, with trailers naming the task, the patch's sha256 and the reviewer (Fila-Task,
    Fila-Patch-Sha256, Reviewed-by), and, when the task has a signed run statement,
    Fila-Provenance: sha256 of its envelope's bytes: ready for a pull request.

    --attestations DIR: after the apply, the run and decision statements (DSSE envelopes, the
    bytes fila keeps) are written to DIR, for `fila verify --patch --attestation --key` anywhere;
    refused before anything lands when the task has no run statement or DIR is not a directory.

    --queue: a task of that PostgreSQL queue, applied to this root (the project) with the same
    checks, its patch and inputs read from the database; the decision is recorded there, once
    for every reviewer.
    """
    from ..api.client import Client

    with Client(root, queue=queue_url) as client:
        if not yes:
            _confirm(client, task_id)
        if branch is not None:
            res, on = client.apply_on_branch(
                task_id, branch, three_way=three_way, by=by, reason=reason,
                allow_git_metadata=allow_git_metadata, allow_credential=allow_credential,
                attestations=attestations,
            )  # fmt: skip
            if json_:
                d = res.record.decision
                print_json({"id": task_id, "status": res.record.status, "branch": branch, "commit": on.commit,
                            "checkout": str(on.top), "decision": d.model_dump(mode="json") if d else None,
                            "superseded": res.superseded, "attestations": res.attestations})  # fmt: skip
                return
            typer.echo(
                safe(
                    f"applied {task_id} as commit {on.commit} on the new branch {branch} of {on.top}; "
                    f"{len(res.written)} written, {len(res.deleted)} deleted; the checkout is untouched"
                )
            )
            for name in res.attestations:
                typer.echo(safe(f"  statement {name}"))
            for tid in res.superseded:
                typer.echo(safe(f"superseded {tid} (same group)"))
            return
        res = client.apply(
            task_id,
            three_way=three_way,
            by=by,
            reason=reason,
            allow_git_metadata=allow_git_metadata,
            allow_credential=allow_credential,
            attestations=attestations,
        )
    _print_applied(task_id, res, json_)


def _confirm(client: Client, task_id: str) -> None:
    """Ask before applying, on a terminal (exit 1 on no)."""
    from ..core.errors import InvalidInput

    if not sys.stdin.isatty():
        raise InvalidInput(
            "apply asks for confirmation and there is no terminal",
            hint="pass --yes to apply without asking (CI)",
        )
    from ..review.report import project_path
    from ..workspace.fswalk import escape_name

    rec = client.record(task_id)
    typer.echo(summary_line(rec), err=True)
    where = escape_name(str(client.root.path) if client.db is not None else project_path(client.root, rec))
    typer.echo(f"project: {where}", err=True)
    if not typer.confirm(f"apply task {safe(task_id)} to {where}?", default=False, err=True):
        to_stderr("fila: nothing applied")
        raise typer.Exit(1)


def _print_applied(task_id: str, res: Any, json_: bool) -> None:
    from ..api.client import applied_json

    d = res.record.decision
    if json_:
        print_json(applied_json(task_id, res))
        return
    typer.echo(
        safe(
            f"applied {task_id} to {res.project}: {len(res.written)} written, "
            f"{len(res.deleted)} deleted"
            + (" (finished an interrupted apply)" if res.resumed else "")
            + (f"; by {d.by}" if d else "")
        )
    )
    for kind, names in (
        ("written", res.written),
        ("deleted", res.deleted),
        ("merged", res.merged),
        ("changed, not in the patch", res.moved_untouched),
    ):
        for name in names:
            typer.echo(f"  {kind:<8} {safe(name)}")
    if res.provenance:
        typer.echo(f"  {safe(res.provenance)}")
    for name in res.attestations:
        typer.echo(f"  statement {safe(name)}")
    for name in res.credential_markers:  # a warning, on stderr like the others
        to_stderr(
            f"fila: warning: {name} landed with fila's marker where the engine had put a known "
            "credential (--allow-credential)"
        )
    for tid in res.superseded:
        typer.echo(safe(f"superseded {tid} (same group)"))
    for tid in res.undecided:
        typer.echo(safe(f"not superseded {tid}: still queued or running; `fila reject` it when it ends"))


def compare(
    group: str,
    root: RootOpt = None,
    json_: JsonOpt = False,
    html_: Annotated[bool, typer.Option("--html", help="one self-contained HTML page on stdout")] = False,
    queue_url: QueueOpt = None,
) -> None:
    """Show a group's tasks side by side: status, files touched, +/- lines, duration, requests,
    tokens, cost, and the check when the task names one (--queue: from that PostgreSQL queue's
    records)."""
    from ..api.client import Client
    from ..review import groups as cmp

    with Client(root, queue=queue_url) as client:
        c = client.compare(group)
    if json_:
        print_json(cmp.to_json(c))
    elif html_:
        typer.echo(cmp.render_html(c), nl=False)
    else:
        for line in cmp.render_lines(c):
            typer.echo(safe(line))


def reject(
    task_id: str,
    root: RootOpt = None,
    reason: ReasonOpt = None,
    by: ByOpt = None,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """Reject a task (ready for review, failed or needing a person) and record why. The project
    is not touched; `fila gc` removes the job directory later. --queue: the decision is recorded
    in that PostgreSQL queue, once for every reviewer."""
    from ..api.client import Client, decision_json

    with Client(root, queue=queue_url) as client:
        rec = client.reject(task_id, by=by, reason=reason)
    d = rec.decision
    if json_:
        print_json(decision_json(task_id, rec))
        return
    typer.echo(
        safe(f"rejected {task_id}" + (f" by {d.by}" + (f": {d.reason}" if d.reason else "") if d else ""))
    )
