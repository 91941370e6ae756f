"""`fila policy suggest`: learn, then lock (README, "Learn, then lock").

It parses, calls `queue.policy.suggest` on the runs' records and prints the proposal as a unified
diff against the policy file (or writes it as a new policy file with `--write`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.layout import Root
from .common import JsonOpt, RootOpt, print_json, safe


def suggest(
    task_ids: Annotated[list[str], typer.Argument(help="runs under one policy (a learning one, usually)")],
    wildcards: Annotated[
        bool,
        typer.Option(
            "--wildcards",
            help="*.suffix for two or more names used below one suffix, only when the suffix is itself "
            "a name the runs used or the policy lists (never a public suffix such as github.io)",
        ),
    ] = False,
    write: Annotated[
        str | None,
        typer.Option(
            "--write",
            metavar="NAME",
            help="write the proposal as policies/NAME.json (not over a file or a shipped policy's name "
            "without --force)",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option(help="with --write: replace an existing policy file or shadow a shipped policy")
    ] = False,
    setup: Annotated[
        bool,
        typer.Option(
            "--setup",
            help="what the runs' project environment setups reached, as the policy's environment.allow "
            "(docs/environments.md)",
        ),
    ] = False,
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The smallest allowlist that would have let these runs do what they did, as a diff against
    their policy (learning off); also names the policy's entries no run used."""
    from ..queue import policy
    from ..queue.store import get_record

    r = Root.at(root).require()
    recs = [get_record(r, t) for t in dict.fromkeys(task_ids)]
    s = policy.suggest(r, recs, wildcards=wildcards, setup=setup)
    written = policy.write_suggested(r, write, s, force=force) if write else None
    if json_:
        print_json(
            {
                "policy": s.name,
                "allow": s.allow,
                "learned": s.learned,
                "unused": s.unused,
                "notes": s.notes,
                "diff": s.diff(write),
                "written": str(written) if written else None,
            }
        )
        return
    # Host names came from the gateway's log of what the engine asked for: escaped on a terminal.
    diff = s.diff(write)
    typer.echo(
        "\n".join(safe(line) for line in diff.splitlines()) or f"policies/{s.name}.json fits these runs"
    )
    for u in s.unused:
        typer.echo(safe(f"unused: {u} (no run in the set used it)"), err=True)
    for n in s.notes:
        typer.echo(safe(f"note: {n}"), err=True)
    if written:
        typer.echo(safe(f"wrote {written}"), err=True)
