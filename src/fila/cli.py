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
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .errors import EXIT_INTERRUPTED, FilaError
from .layout import Root
from .models import Record, Status


class _Group(TyperGroup):
    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FilaError as e:
            args = [*getattr(ctx, "protected_args", []), *ctx.args]
            if "--json" in args:
                typer.echo(json.dumps(e.to_dict()))
            typer.echo(f"fila: error: {e}", err=True)
            if e.hint:
                typer.echo(f"fila: hint: {e.hint}", err=True)
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

app = typer.Typer(cls=_Group, help=HELP, no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None, pretty_exceptions_enable=False)
images_app = typer.Typer(cls=_Group, help="Build and list engine images.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(images_app, name="images")

RootOpt = Annotated[
    Path | None,
    typer.Option("--root", envvar="FILA_ROOT", help="queue root (default: current directory)",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


def _root(root: Path | None) -> Root:
    return Root.at(root)


def _out(data: Any) -> None:
    typer.echo(json.dumps(data, default=str))


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command()
def init(root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Create the queue layout (fila/in, out, logs; sandbox/; policies/) in the root."""
    from .policy import install_shipped

    r = _root(root)
    for d in r.all_dirs():
        d.mkdir(parents=True, exist_ok=True)
    for d in (r.in_dir, r.out_dir, r.logs_dir):
        (d / ".gitkeep").touch()
    ignore = r.path / "sandbox" / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# job directories are large and disposable: fila gc removes them\n*\n")
    copied = install_shipped(r)
    if json_:
        _out({"root": str(r.path), "policies_installed": copied})
        return
    typer.echo(f"initialised fila queue in {r.path}")
    if copied:
        typer.echo(f"policies installed: {', '.join(copied)} (in {r.policies_dir})")


@app.command()
def submit(
    task_file: Annotated[str | None, typer.Argument(
        help="task JSON file (see `fila schema task`); '-' reads stdin", show_default=False)] = None,
    engine: Annotated[str | None, typer.Option(help="engine name (shell, ...)")] = None,
    command: Annotated[str | None, typer.Option(help="shell engine: command run in work/")] = None,
    target: Annotated[list[str] | None, typer.Option(
        "--target", "-t", help="path relative to the project; repeatable")] = None,
    prompt: Annotated[str | None, typer.Option(help="what the engine is asked to do")] = None,
    model: Annotated[str | None, typer.Option(help="model passed to the engine")] = None,
    timeout: Annotated[int | None, typer.Option(help="milliseconds; at most the policy cap")] = None,
    policy: Annotated[str | None, typer.Option(help="policy name (default: default)")] = None,
    task_id: Annotated[str | None, typer.Option("--id", help="task id (default: generated)")] = None,
    fallback: Annotated[list[str] | None, typer.Option(help="engine to try on quota")] = None,
    project: Annotated[str | None, typer.Option(help="project dir (default: root)")] = None,
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Queue a task and print its id on stdout.

    Either give a task file, or describe the task with options; options given with a file
    override its fields. The task is checked now (engine, policy, limits, targets), so a bad
    task is refused here rather than failing later.
    """
    from .cycle import parse_task_file
    from .cycle import submit as do_submit
    from .errors import InvalidInput
    from .models import Task
    from .policy import validate_document

    data: dict[str, Any] = {}
    if task_file == "-":
        import tempfile

        with tempfile.NamedTemporaryFile("wb", suffix=".json") as f:
            f.write(sys.stdin.buffer.read())
            f.flush()
            data = parse_task_file(Path(f.name)).model_dump(exclude_none=True)
    elif task_file:
        data = parse_task_file(Path(task_file)).model_dump(exclude_none=True)
    opts = {"engine": engine, "command": command, "targets": target or None, "prompt": prompt,
            "model": model, "timeout": timeout, "policy": policy, "id": task_id,
            "fallback": fallback or None, "project": project}
    data.update({k: v for k, v in opts.items() if v is not None})
    if not data:
        raise InvalidInput("nothing to submit", hint="give a task file or --engine and --target")
    validate_document("task", data, path=task_file if task_file not in (None, "-") else "options")
    rec = do_submit(_root(root), Task.model_validate(data))
    if json_:
        _out({"id": rec.id, "status": rec.status})
    else:
        typer.echo(rec.id)


def _summary_line(rec: Record) -> str:
    st = rec.diffstat
    diff = f"{st.files} files +{st.insertions} -{st.deletions}" if st else "no diff"
    err = f"  {rec.error.kind}: {rec.error.message}" if rec.error else ""
    total = rec.timings.get("total")
    return f"{rec.id}  {rec.status}  {diff}" + (f"  {total:.1f}s" if total else "") + err


def _record_json(rec: Record) -> dict[str, Any]:
    return rec.model_dump(mode="json")


@app.command("run")
def run_cmd(
    once: Annotated[bool, typer.Option("--once", help="process what is queued, then exit")] = False,
    root: RootOpt = None,
    json_: Annotated[bool, typer.Option(
        "--json", help="one JSON object per processed task on stdout")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress on stderr")] = False,
) -> None:
    """Process queued tasks. With --once (for CI): process what is queued, then exit.

    Progress goes to stderr; results to stdout. Exit 0 when every processed task is ready for
    review, 1 when some failed or need a person, 2 when a task file was invalid, 3 when Docker is
    unavailable or an image is missing (the tasks stay queued).
    """
    if not once:
        worker()
        return
    from .cycle import run_queue

    r = _root(root)

    def on_record(rec: Record) -> None:
        typer.echo(json.dumps(_record_json(rec)) if json_ else _summary_line(rec))

    recs = run_queue(r, on_record=on_record, progress=(lambda _m: None) if quiet else _err)
    if not recs and not quiet:
        _err("fila: nothing queued")
    raise typer.Exit(_exit_for(recs))


def _exit_for(recs: list[Record]) -> int:
    if any(r.status in (Status.failed, Status.needs_human) and not _invalid(r) for r in recs):
        return 1
    if any(_invalid(r) for r in recs):
        return 2
    return 0


def _invalid(rec: Record) -> bool:
    return rec.status == Status.failed and rec.error is not None and rec.error.kind == "invalid"


@app.command()
def worker(
    root: RootOpt = None,
    poll: Annotated[float, typer.Option(help="seconds between looks at an idle queue")] = 1.0,
    json_: JsonOpt = False,
) -> None:
    """Keep processing tasks; wake when a task appears. Ctrl-C stops cleanly."""
    from .cycle import run_queue
    from .sandbox import docker_client

    r = _root(root)
    client = docker_client()
    _err(f"fila worker: watching {r.in_dir}")

    def on_record(rec: Record) -> None:
        typer.echo(json.dumps(_record_json(rec)) if json_ else _summary_line(rec))

    while True:
        run_queue(r, client=client, on_record=on_record, progress=_err)
        time.sleep(poll)


@app.command("ls")
def ls_cmd(
    root: RootOpt = None,
    status: Annotated[Status | None, typer.Option(help="only tasks in this status")] = None,
    json_: JsonOpt = False,
) -> None:
    """List tasks with their status, newest last."""
    from .queue import all_records, queued_files

    r = _root(root).require()
    recs = all_records(r)
    known = {rec.id for rec in recs}
    dropped = [p.stem for p in queued_files(r) if p.stem not in known]
    if status:
        recs = [x for x in recs if x.status == status]
    recs.sort(key=lambda x: x.submitted_at)
    if json_:
        _out([{"id": x.id, "status": x.status, "engine": x.engine, "submitted_at": x.submitted_at,
               "error": x.error.kind if x.error else None,
               "diffstat": x.diffstat.model_dump() if x.diffstat else None} for x in recs]
             + [{"id": d, "status": "queued", "engine": None} for d in dropped
                if status in (None, Status.queued)])
        return
    for x in recs:
        typer.echo(_summary_line(x))
    if status in (None, Status.queued):
        for d in dropped:
            typer.echo(f"{d}  queued  (dropped in fila/in, not yet claimed)")


@app.command()
def show(task_id: str, root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Show a task's record: status, engine, image, policy, timings, diffstat, error."""
    from .queue import get_record

    r = _root(root).require()
    rec = get_record(r, task_id)
    if json_:
        _out(_record_json(rec))
        return
    lines = [f"id:        {rec.id}", f"status:    {rec.status}",
             f"engine:    {rec.engine or '-'}" + (f" (model {rec.model})" if rec.model else "")]
    if rec.image:
        lines.append(f"image:     {rec.image.tag} {rec.image.id or ''}".rstrip())
    if rec.policy:
        lines.append(f"policy:    {rec.policy.name} sha256:{rec.policy.sha256[:12]}")
    lines.append(f"attempt:   {rec.attempt}")
    if rec.exit_code is not None:
        lines.append(f"exit code: {rec.exit_code}")
    if rec.error:
        lines.append(f"error:     {rec.error.kind}: {rec.error.message}")
    if rec.diagnosis:
        lines.append(f"diagnosis: {rec.diagnosis}")
    if rec.timings:
        lines.append("timings:   " + ", ".join(f"{k} {v:.2f}s" for k, v in rec.timings.items()))
    if rec.diffstat:
        s = rec.diffstat
        lines.append(f"diff:      {s.files} files, +{s.insertions} -{s.deletions}"
                     + (f", {s.binary} binary" if s.binary else ""))
        lines += [f"           {_safe(p)}" for p in s.paths]
    if rec.patch_path:
        lines.append(f"patch:     {r.path / rec.patch_path} (sha256 {rec.patch_sha256})")
    if rec.log_path:
        lines.append(f"log:       {r.path / rec.log_path}")
    for w in rec.warnings:
        lines.append(f"warning:   {_safe(w)}")
    if rec.decision:
        d = rec.decision
        lines.append(f"decision:  {d.action} by {d.by} at {d.at}"
                     + (f": {d.reason}" if d.reason else ""))
    typer.echo("\n".join(lines))


def _safe(text: str) -> str:
    """Escape control characters: a file name can carry terminal escape sequences."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@app.command()
def diff(task_id: str, root: RootOpt = None) -> None:
    """Print the task's DIFF.patch, exactly as `fila apply` would apply it."""
    from .queue import get_record

    r = _root(root).require()
    rec = get_record(r, task_id)
    if not rec.patch_path:
        from .errors import NotFound

        raise NotFound(f"task {task_id} has no diff (status {rec.status})", task_id=task_id)
    sys.stdout.buffer.write((r.path / rec.patch_path).read_bytes())
    sys.stdout.flush()


@app.command()
def schema(kind: Annotated[str, typer.Argument(help="task, policy or record")]) -> None:
    """Print the JSON Schema of a file format (the one fila validates against)."""
    from .errors import InvalidInput
    from .models import schema_for

    if kind not in ("task", "policy", "record"):
        raise InvalidInput(f"unknown schema {kind!r}", hint="choose task, policy or record")
    typer.echo(json.dumps(schema_for(kind), indent=2))


@images_app.command("build")
def images_build(
    engine: Annotated[str | None, typer.Argument(help="engine (default: every engine)")] = None,
    base: Annotated[str | None, typer.Option(help="base image (overrides the BASE arg)")] = None,
    ca_file: Annotated[Path | None, typer.Option(
        help="CA bundle to trust in the image (TLS-intercepting proxy)")] = None,
    force: Annotated[bool, typer.Option(help="rebuild even when the image is current")] = False,
    json_: JsonOpt = False,
) -> None:
    """Build engine images locally, also on a host with no registry. A current image is reused."""
    from .engines import engine_names, get_engine
    from .images import build

    names = [engine] if engine else engine_names()
    built = []
    for name in names:
        get_engine(name)
        ref = build(name, base=base, ca_file=ca_file, force=force, progress=_err)
        built.append({"engine": name, "tag": ref.tag, "id": ref.id})
        if not json_:
            typer.echo(f"{name}: {ref.tag} {ref.id}")
    if json_:
        _out(built)


def main() -> None:
    app()
