"""The queue's and the host's upkeep: `fila recover`, `retry`, `rearm`, `status`, `gc`, `doctor`."""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.layout import Root
from .common import ByOpt, JsonOpt, QueueOpt, ReasonOpt, RootOpt, print_json, safe, to_stderr


def recover(
    root: RootOpt = None,
    no_docker: Annotated[
        bool, typer.Option("--no-docker", help="settle files only; leave containers alone")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Settle what crashed workers left: stale claims (requeued before their container started,
    needs_human after), interrupted writes, orphaned containers. Safe while workers run."""
    from ..recovery.recover import recover as do_recover

    rep = do_recover(Root.at(root), docker=not no_docker)
    if json_:
        print_json(rep.to_dict())
        return
    for a in rep.actions:
        typer.echo(safe(f"{a.task_id or '-'}  {a.action}: {a.detail}"))
    typer.echo(
        f"recovered: {len(rep.actions)} actions, {len(rep.containers_removed)} containers "
        f"removed ({rep.backend or 'container engine'}: {rep.docker})"
    )


def retry(
    task_id: str,
    root: RootOpt = None,
    by: ByOpt = None,
    reason: ReasonOpt = None,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """Queue a failed or needs_human task again: a person's decision to run it once more
    (--queue: in that PostgreSQL queue, where any runner may claim it)."""
    from ..review.desk import retry_task

    if queue_url:
        from ..queue.pg.store import PgQueue

        with PgQueue(queue_url) as db:
            rec = retry_task(Root.at(root), db, task_id, by=by, reason=reason)
    else:
        rec = retry_task(Root.at(root), None, task_id, by=by, reason=reason)
    if json_:
        print_json({"id": rec.id, "status": rec.status})
        return
    typer.echo(safe(f"queued {task_id} again (attempt {rec.attempt + 1} next)"))


def rearm(
    root: RootOpt = None,
    by: ByOpt = None,
    reason: ReasonOpt = None,
    json_: JsonOpt = False,
    queue_url: QueueOpt = None,
) -> None:
    """Close the circuit breaker so workers claim again; the rearm is recorded (--queue: that
    PostgreSQL queue's breaker, shared by all its runners)."""
    from ..queue.breaker import rearm as do_rearm
    from ..review.decision import check_reason, decider

    who, why = decider(by), check_reason(reason)
    if queue_url:
        from ..queue.pg.breaker import PgBreaker

        with PgBreaker(queue_url) as db:
            st = db.rearm(by=who, reason=why)
    else:
        st = do_rearm(Root.at(root).require(), by=who, reason=why)
    if json_:
        print_json(st.model_dump())
        return
    typer.echo(safe(f"circuit breaker rearmed by {st.rearmed_by}"))


def status(root: RootOpt = None, json_: JsonOpt = False, queue_url: QueueOpt = None) -> None:
    """Queue counts per state, running jobs (age, heartbeat), the breaker, stale claims.
    --queue: that PostgreSQL queue's counts, its runners (engines, slots, last heartbeat), and
    the queued tasks no live runner can take, counted by why with their first ids (--json: all)."""
    from ..ops.status import gather, gather_queue, render, render_queue

    if queue_url:
        from ..queue.pg.breaker import PgBreaker
        from ..run.remote import LIVE_S

        with PgBreaker(queue_url) as db:
            d = gather_queue(db, live_s=LIVE_S)
        if json_:
            print_json(d)
        else:
            typer.echo("\n".join(safe(line) for line in render_queue(d).split("\n")))
        return
    d = gather(Root.at(root))
    if json_:
        print_json(d)
        return
    typer.echo("\n".join(safe(line) for line in render(d).split("\n")))


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
    from ..recovery.gc import collect, parse_age

    got = collect(Root.at(root), parse_age(older_than), dry_run=dry_run)
    if json_:
        print_json(
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
        typer.echo(safe(f"{verb} {c.id} ({c.status} {c.decided_at}, {c.bytes >> 10} KiB)"))
    typer.echo(f"{verb} {len(got)} job directories ({sum(c.bytes for c in got) >> 10} KiB)")


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
    from ..core.errors import FilaError
    from ..ops import doctor as dr

    rep = dr.run(Root.at(root), self_test=not no_self_test, progress=to_stderr)
    # Policy names and their errors come from the operator's files: escaped like everything else.
    typer.echo(dr.to_json(rep) if json_ else "\n".join(safe(line) for line in dr.render(rep).split("\n")))
    if rep.failed:
        raise FilaError(f"doctor: failed checks: {', '.join(rep.failed)}")
