"""`fila submit`, `fila run` and `fila worker`: tasks into the queue, and a worker to run them.

`submit --run` and `run --once` share one path (`_process`), so a task run in the submitting process
is run and reported exactly as a worker would (docs/architecture.md, the cycle).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core.errors import FilaError
from ..core.layout import Root
from .common import JsonOpt, QueueOpt, RootOpt, print_error, print_json, record_printer, to_stderr

if TYPE_CHECKING:  # pydantic's import costs a third of `fila --help`; commands import it lazily
    from ..api.client import Client
    from ..core.models import Record


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
    environment: Annotated[
        str | None,
        typer.Option(
            "--environment",
            help='the project environment: a declaration relative to the project, or "none" (default: '
            "the project's .devcontainer/devcontainer.json, .devcontainer.json or fila-environment.json)",
            show_default=False,
        ),
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
    queue_url: QueueOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Queue a task and print its id on stdout (a group: one id a line).

    Either give a task file, or describe the task with options; options given with a file
    override its fields. The task is checked now (engine, policy, limits, targets), so a bad
    task is refused here rather than failing later. With --run (CI, one process): the task is
    queued as above, then claimed and run like `fila run --once` would, other queued tasks left.

    With --queue URL (or FILA_QUEUE) the task goes to that PostgreSQL queue, its targets with it
    (checked against this root's policy and limits; a content the database has is not sent
    again); --run then waits until a runner has published its record.
    """
    from ..api.client import Client
    from ..core.errors import InvalidInput
    from ..run.intake import parse_task_bytes, parse_task_file

    data: dict[str, Any] = {}
    if task_file == "-":
        from ..core.untrusted import MAX_TASK_BYTES

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
        "environment": environment,
    }
    given = data or any(v is not None for v in opts.values())  # else the API says: nothing to submit
    if given and model and (len(model) > 1 or "=" in model[0]) and not (engine and len(engine) > 1):
        raise InvalidInput("--model ENGINE=MODEL and a repeated --model are for a group (--engine repeated)",
                           hint="one engine takes one --model MODEL")  # fmt: skip
    source = task_file if task_file not in (None, "-") else "options"
    per_engine = dict(m.split("=", 1) for m in model or [] if "=" in m)
    group = engine if engine and len(engine) > 1 else None
    with Client(root, queue=queue_url) as client:
        if group:
            recs = client.submit_group(data, group, models=per_engine, source=source, **opts)
        else:
            recs = [client.submit(data, source=source, **opts)]
        if run_now and queue_url:  # a runner publishes each record: run --once's exit code
            from ..run.slots import run_exit_code

            recs = [client.wait(r.id) for r in recs]
            for rec in recs:
                record_printer(json_)(rec)
            raise typer.Exit(run_exit_code(recs))
        if run_now:
            _process(client, once=True, only={r.id for r in recs}, json_=json_, quiet=quiet)
    _print_queued(recs, group=bool(group), json_=json_)


def _print_queued(recs: list[Record], *, group: bool, json_: bool) -> None:
    """What `submit` prints of the tasks it queued: the ids, a line each, or JSON."""
    if group and json_:
        print_json({"group": recs[0].task.group if recs[0].task else None,
                    "tasks": [{"id": r.id, "engine": r.task.engine if r.task else None, "status": r.status}
                              for r in recs]})  # fmt: skip
    elif json_:
        print_json({"id": recs[0].id, "status": recs[0].status})
    else:
        for r in recs:
            typer.echo(r.id)


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
    queue_url: QueueOpt = None,
    host_id: Annotated[
        str | None,
        typer.Option(
            "--host-id", help="with --queue: this runner's name in the database (default: host-pid)"
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine", help="with --queue: claim only these engines (default: those with an image)"
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="with --queue: claim only tasks of these policies (default: those of --root it can run: "
            "that load, whose runtime the container engine has; said at start)",
        ),
    ] = None,
    lease: Annotated[
        float,
        typer.Option(
            "--lease", min=3.0, help="with --queue: seconds of a claim's lease, renewed every third"
        ),
    ] = 30.0,
) -> None:
    """Keep processing tasks; wake within a second when a task appears (inotify).

    Recovery runs in the background at start and every 30 s. SIGTERM: no new claims, jobs not
    yet started go back to the queue, running ones get --grace seconds. Ctrl-C: running
    containers are removed and their tasks recorded (needs_human). Exit codes as `run --once`.

    With --queue URL (or FILA_QUEUE): a runner of that PostgreSQL queue, --root its own local
    directory (policies, job roots); it claims the tasks of the engines it has (and of the
    --policy names, when given), --concurrency at a time. SIGTERM or Ctrl-C stop its jobs at once.
    """
    if queue_url:
        _process_remote(root, queue_url, once=once, json_=json_, quiet=quiet, poll=poll,
                        host_id=host_id, engines=engine, policies=policy, lease=lease,
                        concurrency=concurrency)  # fmt: skip
    from ..api.client import Client

    with Client(root) as client:
        _process(client, once=once, json_=json_, quiet=quiet, concurrency=concurrency, poll=poll, grace=grace)


def _process_remote(
    root: Path | None,
    url: str,
    *,
    once: bool,
    json_: bool,
    quiet: bool,
    poll: float,
    host_id: str | None,
    engines: list[str] | None,
    lease: float,
    policies: list[str] | None = None,
    concurrency: int = 1,
) -> None:
    """A runner of the PostgreSQL queue (run/remote.py); exits with its code (never returns)."""
    from ..run.remote import RemoteWorker

    w = RemoteWorker(
        Root.at(root),
        url,
        host_id=host_id,
        engines=engines,
        policies=policies,
        once=once,
        concurrency=concurrency,
        lease_s=lease,
        poll_s=poll,
        on_record=record_printer(json_),
        progress=(lambda _m: None) if quiet else to_stderr,
    )
    code = w.run()
    if w.infra_error is not None:
        print_error(w.infra_error)
    raise typer.Exit(code)


def _process(
    client: Client,
    *,
    once: bool,
    json_: bool,
    quiet: bool,
    only: set[str] | None = None,
    concurrency: int = 1,
    poll: float = 1.0,
    grace: float = 60.0,
) -> None:
    """Run a worker in this process (`only`: just these tasks) and exit with its code (never
    returns)."""
    quiet_ = (lambda _m: None) if quiet else to_stderr
    # The process exits next: a one-shot's gateways still being removed are a reaper's.
    run = client.run(only, once=once, concurrency=concurrency, poll_s=poll, grace_s=grace,
                     on_record=record_printer(json_), progress=quiet_, detach_teardown=once)  # fmt: skip
    if once and not run.records and not quiet and run.code == 0:
        to_stderr("fila: nothing queued")
    for e in (run.infra_error, run.crash):
        if isinstance(e, FilaError):
            print_error(e)
    if once and run.breaker_tripped:
        to_stderr(
            "fila: error: the circuit breaker is open; `fila status` shows why, `fila rearm` "
            "lets workers claim again"
        )
    raise typer.Exit(run.code)
