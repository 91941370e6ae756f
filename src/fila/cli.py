"""The `fila` command line. It only parses, calls the core and formats.

Errors are caught in one place (`_Group.invoke`): a `FilaError` prints what failed and what to do
next, and exits with its code. Exit codes (also in `fila --help` and the README):

  0  success; with `run --once`, every task processed is ready for review
  1  some task failed or needs a person (run --once), or another failure
  2  invalid input: bad arguments, a task or policy file that does not validate
  3  Docker unavailable or an image missing; queued tasks stay queued
  4  refused: duplicate id, a status change not allowed, apply refused
  5  no such task
  6  the worker's circuit breaker is open (`fila rearm`)
  130 interrupted
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from .core.errors import EXIT_INTERRUPTED, FilaError
from .core.layout import Root
from .core.states import Status

if TYPE_CHECKING:  # pydantic's import costs a third of `fila --help`; commands import it lazily
    from .core.models import Record


class _Commands(MutableMapping[str, Any]):
    """A group's commands by name, each built by typer (`get_command_from_info`) on first use.

    typer builds every command of a group before parsing anything: the signatures and options of
    twenty commands, about a third of `fila --help`, where one command runs. Built lazily, the
    command a process runs is the very object typer's eager build makes (tests/test_cli_startup.py
    compares both builds' help and parameters, command by command), and the others cost nothing.
    """

    def __init__(self, builders: dict[str, Callable[[], Any]], summaries: dict[str, Callable[[], Any]]):
        self._builders = builders
        self._summaries = summaries
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            self._built[name] = self._builders[name]()  # KeyError: no such command
        return self._built[name]

    def __setitem__(self, name: str, cmd: Any) -> None:
        self._builders[name] = lambda: cmd
        self._built[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._builders[name]
        self._built.pop(name, None)
        self._summaries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._builders  # without building it

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)  # registration order, as typer lists them

    def __len__(self) -> int:
        return len(self._builders)

    def summary(self, name: str) -> Any:
        """What a group's help lists for a command (name, short help, hidden): the command itself
        when built, else the same command without its parameters, which the listing never reads."""
        if name in self._built or name not in self._summaries:
            return self[name]
        return self._summaries[name]()


class _Group(TyperGroup):
    _listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(self.commands)  # typer's order, without building every command to list names

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        if self._listing and isinstance(self.commands, _Commands) and cmd_name in self.commands:
            return self.commands.summary(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: typer.Context, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False

    def invoke(self, ctx: typer.Context) -> Any:
        # Read before the group runs the command: resolving it empties both lists.
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        args = [*protected, *ctx.args]
        try:
            return super().invoke(ctx)
        except FilaError as e:
            if "--json" in args:
                typer.echo(json.dumps(e.to_dict()))
            # A message may quote a task's field, a file name in fila/in or a policy name.
            typer.echo(f"fila: error: {_safe(str(e))}", err=True)
            if e.hint:
                typer.echo(f"fila: hint: {_safe(e.hint)}", err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("fila: interrupted", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None


HELP = """fila runs AI coding engines (or a shell command) on copies of your files in a throwaway,
hardened Docker container, and stops at a diff that a person reviews before anything lands.

\b
Typical use:
  fila init
  fila submit --engine shell --command "sed -i s/hello/world/ greeting.txt" --target greeting.txt
  fila run --once
  fila show ID ; fila diff ID

\b
Exit codes:
  0 success (run --once: every task is ready for review)   1 some task failed
  2 invalid input   3 Docker unavailable or image missing (tasks stay queued)
  4 refused (duplicate id, status change not allowed)   5 no such task
  6 circuit breaker open   130 interrupted
"""

app = typer.Typer(
    cls=_Group,
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
images_app = typer.Typer(
    cls=_Group, help="Build and list engine images.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(images_app, name="images")

RootOpt = Annotated[
    Path | None,
    typer.Option(
        "--root", envvar="FILA_ROOT", help="queue root (default: current directory)", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
ByOpt = Annotated[
    str | None,
    typer.Option("--by", help="who decides (default: $FILA_USER, else the login name)", show_default=False),
]
ReasonOpt = Annotated[str | None, typer.Option("--reason", "-m", help="why (recorded)")]


def _root(root: Path | None) -> Root:
    return Root.at(root)


def _out(data: Any) -> None:
    typer.echo(json.dumps(data, default=str))


def _err(msg: str) -> None:
    # Progress and failures of running tasks quote their fields and errors: escaped per line.
    typer.echo("\n".join(_safe(line) for line in msg.split("\n")), err=True)


@app.command()
def init(
    root: RootOpt = None,
    backend: Annotated[
        str | None,
        typer.Option(help="container backend of this root: docker (default) or podman (rootless)"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Create the queue layout (fila/in, out, logs; sandbox/; policies/) in the root."""
    from .queue.policy import install_shipped
    from .sandbox import check_name, set_root_backend

    r = _root(root)
    if backend is not None:
        check_name(backend)  # before anything is created
    copied = install_shipped(r.create())
    if backend is not None:
        set_root_backend(r, backend)
    if json_:
        _out({"root": str(r.path), "policies_installed": copied, "backend": backend})
        return
    typer.echo(f"initialised fila queue in {r.path}" + (f" (backend {backend})" if backend else ""))
    if copied:
        typer.echo(f"policies installed: {', '.join(copied)} (in {r.policies_dir})")


@app.command()
def submit(
    task_file: Annotated[
        str | None,
        typer.Argument(help="task JSON file (see `fila schema task`); '-' reads stdin", show_default=False),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            help="engine name (shell, claude, ...); repeated: one task per engine in a compare group "
            "(ids GROUP.ENGINE, GROUP from --id or the file's group/id)"
        ),
    ] = None,
    command: Annotated[str | None, typer.Option(help="shell engine: command run in work/")] = None,
    target: Annotated[
        list[str] | None, typer.Option("--target", "-t", help="path relative to the project; repeatable")
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="what the engine is asked to do")] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(help="model passed to the engine; in a group, ENGINE=MODEL (repeatable) per engine"),
    ] = None,
    timeout: Annotated[int | None, typer.Option(help="milliseconds; at most the policy cap")] = None,
    policy: Annotated[str | None, typer.Option(help="policy name (default: default)")] = None,
    task_id: Annotated[str | None, typer.Option("--id", help="task id (default: generated)")] = None,
    fallback: Annotated[list[str] | None, typer.Option(help="engine to try on quota")] = None,
    project: Annotated[str | None, typer.Option(help="project dir (default: root)")] = None,
    image: Annotated[
        str | None, typer.Option(help="pin the engine's image: a tag or an image id (sha256:...)")
    ] = None,
    check: Annotated[
        str | None,
        typer.Option(help="command run on a copy of work/ after the engine (network none); recorded"),
    ] = None,
    run_now: Annotated[
        bool,
        typer.Option(
            "--run",
            help="then run it in this process as `run --once` would (only this task or group): "
            "prints its record (--json: the full record), exit codes as `run --once`",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="with --run: no progress on stderr")] = False,
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Queue a task and print its id on stdout (a group: one id a line).

    Either give a task file, or describe the task with options; options given with a file
    override its fields. The task is checked now (engine, policy, limits, targets), so a bad
    task is refused here rather than failing later. With --run (CI, one process): the task is
    queued as above, then claimed and run like `fila run --once` would, other queued tasks left.
    """
    from .core.errors import InvalidInput
    from .core.models import Task
    from .queue.policy import validate_document
    from .run.job import parse_task_bytes, parse_task_file
    from .run.job import submit as do_submit

    data: dict[str, Any] = {}
    if task_file == "-":
        from .core.untrusted import MAX_TASK_BYTES

        raw = sys.stdin.buffer.read(MAX_TASK_BYTES + 1)  # capped: stdin may be endless
        data = parse_task_bytes(raw, source="stdin").model_dump(exclude_none=True)
    elif task_file:
        data = parse_task_file(Path(task_file)).model_dump(exclude_none=True)
    opts = {
        "engine": engine[0] if engine else None,
        "command": command,
        "targets": target or None,
        "prompt": prompt,
        "model": model[0] if model and len(model) == 1 and "=" not in model[0] else None,
        "timeout": timeout,
        "policy": policy,
        "id": task_id,
        "fallback": fallback or None,
        "project": project,
        "image": image,
        "check": check,
    }
    data.update({k: v for k, v in opts.items() if v is not None})
    if not data:
        raise InvalidInput("nothing to submit", hint="give a task file or --engine and --target")
    if model and (len(model) > 1 or "=" in model[0]) and not (engine and len(engine) > 1):
        raise InvalidInput("--model ENGINE=MODEL and a repeated --model are for a group (--engine repeated)",
                           hint="one engine takes one --model MODEL")  # fmt: skip
    validate_document("task", data, path=task_file if task_file not in (None, "-") else "options")
    if engine and len(engine) > 1:
        from .review.groups import group_tasks
        from .run.job import submit_group

        per_engine = dict(m.split("=", 1) for m in model or [] if "=" in m)
        recs = submit_group(_root(root), group_tasks(Task.model_validate(data), engine, models=per_engine))
        if run_now:
            _process(root, once=True, only={r.id for r in recs}, json_=json_, quiet=quiet)
        if json_:
            _out({"group": recs[0].task.group if recs[0].task else None,
                  "tasks": [{"id": r.id, "engine": r.task.engine if r.task else None, "status": r.status}
                            for r in recs]})  # fmt: skip
        else:
            for r in recs:
                typer.echo(r.id)
        return
    rec = do_submit(_root(root), Task.model_validate(data))
    if run_now:
        _process(root, once=True, only={rec.id}, json_=json_, quiet=quiet)
    if json_:
        _out({"id": rec.id, "status": rec.status})
    else:
        typer.echo(rec.id)


def _summary_line(rec: Record) -> str:
    st = rec.diffstat
    diff = f"{st.files} files +{st.insertions} -{st.deletions}" if st else "no diff"
    err = f"  {rec.error.kind}: {rec.error.message}" if rec.error else ""
    total = rec.timings.get("total")
    return _safe(f"{rec.id}  {rec.status}  {diff}" + (f"  {total:.1f}s" if total else "") + err)


def _record_json(rec: Record) -> dict[str, Any]:
    return rec.model_dump(mode="json")


@app.command("run")
def run_cmd(
    once: Annotated[bool, typer.Option("--once", help="process what is queued, then exit")] = False,
    root: RootOpt = None,
    json_: Annotated[
        bool, typer.Option("--json", help="one JSON object per processed task on stdout")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress on stderr")] = False,
    concurrency: Annotated[int, typer.Option("--concurrency", "-j", min=1, help="jobs run at once")] = 1,
) -> None:
    """Process queued tasks. With --once (for CI): process what is queued, then exit.

    Progress goes to stderr; results to stdout. Exit 0 when every processed task is ready for
    review, 1 when some failed or need a person, 2 when a task file was invalid, 3 when Docker is
    unavailable or an image is missing (the tasks stay queued), 6 when the circuit breaker is
    open, 130 when interrupted (running containers removed, tasks recorded).
    """
    worker(root=root, once=once, json_=json_, quiet=quiet, concurrency=concurrency)


@app.command()
def worker(
    root: RootOpt = None,
    once: Annotated[bool, typer.Option("--once", help="process what is queued, then exit")] = False,
    concurrency: Annotated[int, typer.Option("--concurrency", "-j", min=1, help="jobs run at once")] = 1,
    poll: Annotated[float, typer.Option(help="seconds between looks when inotify is missing")] = 1.0,
    grace: Annotated[
        float, typer.Option(help="after SIGTERM, seconds running jobs get to finish before they are stopped")
    ] = 60.0,
    json_: Annotated[
        bool, typer.Option("--json", help="one JSON object per processed task on stdout")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress on stderr")] = False,
) -> None:
    """Keep processing tasks; wake within a second when a task appears (inotify).

    Recovery runs in the background at start and every 30 s. SIGTERM: no new claims, jobs not
    yet started go back to the queue, running ones get --grace seconds. Ctrl-C: running
    containers are removed and their tasks recorded (needs_human). Exit codes as `run --once`.
    """
    _process(root, once=once, json_=json_, quiet=quiet, concurrency=concurrency, poll=poll, grace=grace)


def _process(
    root: Path | None,
    *,
    once: bool,
    json_: bool,
    quiet: bool,
    only: set[str] | None = None,
    concurrency: int = 1,
    poll: float = 1.0,
    grace: float = 60.0,
) -> None:
    """Run a worker (`only`: just these tasks) and exit with its code (never returns)."""
    from .run.worker import Worker

    def on_record(rec: Record) -> None:
        typer.echo(json.dumps(_record_json(rec)) if json_ else _summary_line(rec))

    w = Worker(
        _root(root),
        once=once,
        concurrency=concurrency,
        poll_s=poll,
        grace_s=grace,
        on_record=on_record,
        progress=(lambda _m: None) if quiet else _err,
        only=only,
    )
    code = w.run()
    if once and not w.records and not quiet and code == 0:
        _err("fila: nothing queued")
    for e in (w.infra_error, w.crash):
        if isinstance(e, FilaError):
            _err(f"fila: error: {e}" + (f"\nfila: hint: {e.hint}" if e.hint else ""))
    if once and w.breaker_tripped:
        _err(
            "fila: error: the circuit breaker is open; `fila status` shows why, `fila rearm` "
            "lets workers claim again"
        )
    raise typer.Exit(code)


@app.command()
def recover(
    root: RootOpt = None,
    no_docker: Annotated[
        bool, typer.Option("--no-docker", help="settle files only; leave containers alone")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Settle what crashed workers left: stale claims (requeued before their container started,
    needs_human after), interrupted writes, orphaned containers. Safe while workers run."""
    from .recovery.recover import recover as do_recover

    rep = do_recover(_root(root), docker=not no_docker)
    if json_:
        _out(rep.to_dict())
        return
    for a in rep.actions:
        typer.echo(_safe(f"{a.task_id or '-'}  {a.action}: {a.detail}"))
    typer.echo(
        f"recovered: {len(rep.actions)} actions, {len(rep.containers_removed)} containers "
        f"removed ({rep.backend or 'container engine'}: {rep.docker})"
    )


@app.command()
def retry(
    task_id: str,
    root: RootOpt = None,
    by: ByOpt = None,
    reason: ReasonOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Queue a failed or needs_human task again: a person's decision to run it once more."""
    from .queue.store import retry as do_retry
    from .review.decision import check_reason, decider

    rec = do_retry(_root(root).require(), task_id, by=decider(by), reason=check_reason(reason))
    if json_:
        _out({"id": rec.id, "status": rec.status})
        return
    typer.echo(_safe(f"queued {task_id} again (attempt {rec.attempt + 1} next)"))


@app.command()
def rearm(
    root: RootOpt = None,
    by: ByOpt = None,
    reason: ReasonOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Close the circuit breaker so workers claim again; the rearm is recorded."""
    from .queue.breaker import rearm as do_rearm
    from .review.decision import check_reason, decider

    st = do_rearm(_root(root).require(), by=decider(by), reason=check_reason(reason))
    if json_:
        _out(st.model_dump())
        return
    typer.echo(_safe(f"circuit breaker rearmed by {st.rearmed_by}"))


@app.command()
def status(root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Queue counts per state, running jobs (age, heartbeat), the breaker, stale claims."""
    from .ops.status import gather, render

    d = gather(_root(root))
    if json_:
        _out(d)
        return
    typer.echo("\n".join(_safe(line) for line in render(d).split("\n")))


@app.command("ls")
def ls_cmd(
    root: RootOpt = None,
    status: Annotated[Status | None, typer.Option(help="only tasks in this status")] = None,
    json_: JsonOpt = False,
) -> None:
    """List tasks with their status, newest last."""
    from .queue.store import listing

    recs, dropped = listing(_root(root).require(), status)
    if json_:
        _out(
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
        )
        return
    for x in recs:
        typer.echo(_summary_line(x))
    for d in dropped:
        typer.echo(f"{_safe(d)}  queued  (dropped in fila/in, not yet claimed)")


@app.command()
def show(task_id: str, root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Show a task's record: status, engine, image, policy, timings, diffstat, error."""
    from .queue.store import get_record
    from .review.report import project_path
    from .workspace.fswalk import escape_name

    r = _root(root).require()
    rec = get_record(r, task_id)
    if json_:
        _out(_record_json(rec))
        return
    lines = [
        f"id:        {rec.id}",
        f"project:   {escape_name(project_path(r, rec))}",
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
    for a in rec.attempts:
        if a.outcome == "quota":  # an engine that fell back: the rest is in `show --json`
            log = f" (log {r.path / a.log_path})" if a.log_path else ""
            lines.append(f"fell back: {a.engine} out of quota{log}")
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
        lines += [f"           {_safe(p)}" for p in s.paths]
    if rec.patch_path:
        lines.append(f"patch:     {r.path / rec.patch_path} (sha256 {rec.patch_sha256})")
    if rec.log_path:
        lines.append(f"log:       {r.path / rec.log_path}")
    for w in rec.warnings:
        lines.append(f"warning:   {_safe(w)}")
    from .egress.config import lines as egress_lines

    lines += egress_lines(rec.egress)
    if rec.decision:
        d = rec.decision
        lines.append(f"decision:  {d.action} by {d.by} at {d.at}" + (f": {d.reason}" if d.reason else ""))
    # Each line escaped whole: id, model, image, policy, error, decision all come from files.
    typer.echo("\n".join(_safe(line) for line in lines))


def _safe(text: str) -> str:
    """Text from the engine as it may be shown (a name can carry terminal escape sequences)."""
    from .workspace.fswalk import inert

    return inert(text)


@app.command()
def logs(
    task_id: str,
    root: RootOpt = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing while the task is queued or running")
    ] = False,
    events: Annotated[bool, typer.Option("--events", help="the task's event log (JSON lines)")] = False,
) -> None:
    """Print a task's engine output (fila/logs/ID.log), or with --events its event log.

    On a terminal, control characters from the engine are shown escaped; piped, the bytes are
    written as they are. --follow is progress for long work: it ends when the task is decided.
    """
    from .queue.store import log_chunks

    tty = sys.stdout.isatty()
    for data in log_chunks(_root(root).require(), task_id, events=events, follow=follow):
        if tty:
            from .workspace.fswalk import inert

            typer.echo("\n".join(inert(x) for x in data.split(b"\n")), nl=False)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()


@app.command()
def diff(task_id: str, root: RootOpt = None) -> None:
    """Print the task's DIFF.patch, exactly as `fila apply` would apply it.

    The patch is checked against the sha256 in the record first. On a terminal, control
    characters are escaped (a hostile line could otherwise hide itself with escape sequences);
    piped, the bytes are written unchanged, e.g. for `git apply`.
    """
    from .queue.store import get_record
    from .review.patch import policy_for, read_reviewed

    r = _root(root).require()
    rec = get_record(r, task_id)
    data = read_reviewed(r, rec, policy_for(r, rec))
    if rec.credentials_in_diff is not None:  # on stderr: the patch on stdout stays a patch
        from .workspace.secretscan import diff_warning

        found = rec.credentials_in_diff
        _err(f"fila: warning: {diff_warning(found.counts, len(found.files))}")
    if sys.stdout.isatty():
        from .workspace.fswalk import inert

        typer.echo("\n".join(inert(line) for line in data.split(b"\n")), nl=False)
        return
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


# -- the review gate: review, apply, reject, gc (fila.review, fila.apply, fila.decision, fila.gc)


@app.command()
def review(
    task_id: str,
    root: RootOpt = None,
    html: Annotated[
        bool,
        typer.Option(
            "--html", help="write a self-contained REVIEW.html in the job directory; print its path"
        ),
    ] = False,
    no_pager: Annotated[bool, typer.Option("--no-pager", help="print, do not page")] = False,
    json_: JsonOpt = False,
) -> None:
    """Show what a decision is about: engine, model, policy, timings, files, warnings, and the
    diff, read from DIFF.patch after checking its sha256 (refused when it changed).

    Colors and the pager ($PAGER, default less -R) only on a terminal. Control characters in
    names and contents are shown escaped.
    """
    import os

    from .review import report as rv

    r = _root(root)
    got = rv.load(r, task_id)
    if html:
        path = rv.write_html(r, got)
        if json_:
            _out({"id": task_id, "html": str(path)})
        else:
            typer.echo(str(path))
        return
    if json_:
        _out(rv.to_json(got))
        return
    tty = sys.stdout.isatty()
    text = rv.render_text(got, color=tty and "NO_COLOR" not in os.environ)
    rv.page(text, enabled=tty and not no_pager)


@app.command("apply")
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
    json_: JsonOpt = False,
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
    """
    from .core.errors import InvalidInput
    from .queue.store import get_record
    from .review.apply import apply

    r = _root(root)
    if not yes:
        if not sys.stdin.isatty():
            raise InvalidInput(
                "apply asks for confirmation and there is no terminal",
                hint="pass --yes to apply without asking (CI)",
            )
        from .review.report import project_path
        from .workspace.fswalk import escape_name

        rec = get_record(r.require(), task_id)
        typer.echo(_summary_line(rec), err=True)
        where = escape_name(project_path(r, rec))
        typer.echo(f"project: {where}", err=True)
        if not typer.confirm(f"apply task {_safe(task_id)} to {where}?", default=False, err=True):
            _err("fila: nothing applied")
            raise typer.Exit(1)
    res = apply(r, task_id, by=by, reason=reason, three_way=three_way, allow_git_metadata=allow_git_metadata,
                allow_credential=allow_credential)  # fmt: skip
    d = res.record.decision
    if json_:
        _out(
            {
                "id": task_id,
                "status": res.record.status,
                "project": str(res.project),
                "decision": d.model_dump(mode="json") if d else None,
                "written": res.written,
                "deleted": res.deleted,
                "merged": res.merged,
                "resumed": res.resumed,
                "changed_not_touched": res.moved_untouched,
                "superseded": res.superseded,
                "not_superseded": res.undecided,
                "credential_markers": res.credential_markers,
            }
        )
        return
    typer.echo(
        _safe(
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
            typer.echo(f"  {kind:<8} {_safe(name)}")
    for name in res.credential_markers:  # a warning, on stderr like the others
        _err(
            f"fila: warning: {name} landed with fila's marker where the engine had put a known "
            "credential (--allow-credential)"
        )
    for tid in res.superseded:
        typer.echo(_safe(f"superseded {tid} (same group)"))
    for tid in res.undecided:
        typer.echo(_safe(f"not superseded {tid}: still queued or running; `fila reject` it when it ends"))


@app.command()
def compare(
    group: str,
    root: RootOpt = None,
    json_: JsonOpt = False,
    html_: Annotated[bool, typer.Option("--html", help="one self-contained HTML page on stdout")] = False,
) -> None:
    """Show a group's tasks side by side: status, files touched, +/- lines, duration, requests,
    tokens, cost, and the check when the task names one."""
    from .review import groups as cmp

    c = cmp.compare(_root(root), group)
    if json_:
        _out(cmp.to_json(c))
    elif html_:
        typer.echo(cmp.render_html(c), nl=False)
    else:
        for line in cmp.render_lines(c):
            typer.echo(_safe(line))


@app.command()
def reject(
    task_id: str,
    root: RootOpt = None,
    reason: ReasonOpt = None,
    by: ByOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Reject a task (ready for review, failed or needing a person) and record why. The project
    is not touched; `fila gc` removes the job directory later."""
    from .review.decision import reject as do_reject

    rec = do_reject(_root(root), task_id, by=by, reason=reason)
    d = rec.decision
    if json_:
        _out({"id": task_id, "status": rec.status, "decision": d.model_dump(mode="json") if d else None})
        return
    typer.echo(
        _safe(f"rejected {task_id}" + (f" by {d.by}" + (f": {d.reason}" if d.reason else "") if d else ""))
    )


@app.command("gc")
def gc_cmd(
    root: RootOpt = None,
    older_than: Annotated[
        str, typer.Option("--older-than", help="age of the decision: 30s, 15m, 12h, 14d")
    ] = "14d",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list, remove nothing")] = False,
    json_: JsonOpt = False,
) -> None:
    """Remove job directories (sandbox/jobs/ID, sandbox/meta/ID) of tasks applied or rejected
    longer ago than --older-than. Never a task that is not decided; records and logs stay."""
    from .recovery.gc import collect, parse_age

    got = collect(_root(root), parse_age(older_than), dry_run=dry_run)
    if json_:
        _out(
            [
                {
                    "id": c.id,
                    "status": c.status,
                    "decided_at": c.decided_at,
                    "paths": c.paths,
                    "bytes": c.bytes,
                    "removed": not dry_run,
                }
                for c in got
            ]
        )
        return
    verb = "would remove" if dry_run else "removed"
    for c in got:
        typer.echo(_safe(f"{verb} {c.id} ({c.status} {c.decided_at}, {c.bytes >> 10} KiB)"))
    typer.echo(f"{verb} {len(got)} job directories ({sum(c.bytes for c in got) >> 10} KiB)")


@app.command()
def doctor(
    root: RootOpt = None,
    json_: JsonOpt = False,
    no_self_test: Annotated[
        bool, typer.Option("--no-self-test", help="skip the containers of the self-test")
    ] = False,
) -> None:
    """Check this host: the container engine, runtimes, images built, every policy of the root,
    and a self-test with real containers (no network under none, the allowlist lets a listed host
    through and refuses another, input/ read-only, no capabilities). Exit 1 naming what failed."""
    from .core.errors import FilaError
    from .ops import doctor as dr

    rep = dr.run(_root(root), self_test=not no_self_test, progress=_err)
    # Policy names and their errors come from the operator's files: escaped like everything else.
    typer.echo(dr.to_json(rep) if json_ else "\n".join(_safe(line) for line in dr.render(rep).split("\n")))
    if rep.failed:
        raise FilaError(f"doctor: failed checks: {', '.join(rep.failed)}")


@app.command()
def schema(
    kind: Annotated[str, typer.Argument(help="task, policy or record")],
    root: RootOpt = None,
) -> None:
    """Print the JSON Schema of a file format (the one fila validates against). The formats are
    fila's, not a queue root's: --root is accepted, like every command's, and changes nothing."""
    from .core.errors import InvalidInput
    from .core.models import schema_for

    if kind not in ("task", "policy", "record"):
        raise InvalidInput(f"unknown schema {kind!r}", hint="choose task, policy or record")
    typer.echo(json.dumps(schema_for(kind), indent=2))


@images_app.command("build")
def images_build(
    engine: Annotated[
        list[str] | None,
        typer.Argument(
            help="engines, or support images: gateway, testnet (default: every engine)", show_default=False
        ),
    ] = None,
    base: Annotated[str | None, typer.Option(help="base image (overrides the BASE arg)")] = None,
    ca_file: Annotated[
        Path | None, typer.Option(help="CA bundle to trust in the image (TLS-intercepting proxy)")
    ] = None,
    force: Annotated[bool, typer.Option(help="rebuild even when the image is current")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="the build's raw output, not a line per Dockerfile step")
    ] = False,
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Build engine images locally, also on a host with no registry. A current image is reused."""
    from .engines import engine_names, get_engine
    from .sandbox import get_backend, root_backend
    from .sandbox.images import SUPPORT_IMAGES

    names = list(dict.fromkeys(engine)) if engine else engine_names()
    for name in names:
        if name not in SUPPORT_IMAGES:
            get_engine(name)  # an unknown name lists the valid engines, before anything is built
    built = []
    r = _root(root)
    backend = get_backend(root_backend(r) if r.fila.is_dir() else None)
    for name in names:
        ref = backend.build(name, base=base, ca_file=ca_file, force=force, progress=_err, verbose=verbose)
        built.append({"engine": name, "tag": ref.tag, "id": ref.id})
        if not json_:
            typer.echo(f"{name}: {ref.tag} {ref.id}")
    if json_:
        _out(built)


def lazy_command(typer_app: typer.Typer) -> TyperGroup:
    """The click group typer makes of `typer_app` (`typer.main.get_command`), its commands and
    sub-groups built on first use (`_Commands`): made by typer's own functions, with the app's
    own settings, so parsing, help and errors are typer's."""
    import copy
    import functools
    import inspect

    from typer import main as tm

    shell = copy.copy(typer_app)  # the group itself (help, settings, callback), no commands yet
    shell.registered_commands, shell.registered_groups = [], []
    group = tm.get_group(shell)
    kw: dict[str, Any] = {
        "pretty_exceptions_short": typer_app.pretty_exceptions_short,
        "rich_markup_mode": typer_app.rich_markup_mode,
    }
    builders: dict[str, Callable[[], Any]] = {}
    summaries: dict[str, Callable[[], Any]] = {}
    for info in typer_app.registered_commands:
        assert info.callback is not None
        name = info.name or tm.get_command_name(info.callback.__name__)
        builders[name] = functools.partial(tm.get_command_from_info, info, **kw)
        doc = inspect.getdoc(info.callback) if info.help is None else inspect.cleandoc(info.help)
        summaries[name] = functools.partial(
            info.cls or TyperCommand,
            name=name,
            help=doc,
            short_help=info.short_help,
            hidden=info.hidden,
            deprecated=info.deprecated,
            rich_markup_mode=typer_app.rich_markup_mode,
        )
    for sub in typer_app.registered_groups:  # `fila images`: built (its one command too) when used
        assert isinstance(sub.name, str), "fila names its sub-groups (add_typer(..., name=))"
        builders[sub.name] = functools.partial(
            tm.get_group_from_info, sub, **kw, suggest_commands=typer_app.suggest_commands
        )
    group.commands = _Commands(builders, summaries)
    return group


def main() -> None:
    """The console script: typer's group of `app`, each command built when it runs."""
    lazy_command(app)()
