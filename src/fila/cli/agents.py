"""`fila mcp`: the queue and the review gate for an agent, as an MCP server (docs/mcp.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import QueueOpt, RootOpt


def mcp_cmd(
    root: RootOpt = None,
    queue_url: QueueOpt = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="a policy MCP clients may name (repeatable; default: `default` only, so that no task "
            "spends the operator's model credentials unless allowed); a task naming any other is refused",
            show_default=False,
        ),
    ] = None,
    allow_decide: Annotated[
        bool,
        typer.Option("--allow-decide", help="offer the apply and reject tools (default: a person decides)"),
    ] = False,
    decide_any: Annotated[
        bool,
        typer.Option(
            "--decide-any",
            help="with --allow-decide: let MCP clients decide every task of the root, a person's too "
            "(default: only tasks submitted through MCP)",
        ),
    ] = False,
    max_live_tasks: Annotated[
        int,
        typer.Option(
            "--max-live-tasks",
            min=1,
            help="tasks submitted through this server that may be queued or running at once; a submit "
            "beyond is refused",
        ),
    ] = 20,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            metavar="HOST:PORT",
            help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio; every request needs "
            "the bearer token (--token-file, $FILA_MCP_TOKEN, else one generated into "
            "<root>/fila/state/mcp.token, mode 0600)",
            show_default=False,
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="with --http: a file (yours, mode 0600) holding the bearer token every request must "
            "carry (else $FILA_MCP_TOKEN, else a generated one)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve fila to an agent over the Model Context Protocol (stdio by default).

    Tools: submit (engine, prompt, targets, policy, check, fallback, command, an id), wait, status,
    review (summary, warnings, the diff), log, compare; with --allow-decide also apply and reject of
    the tasks submitted through MCP (--decide-any: every task), decided as `mcp:<client name>`. A
    task submitted here is an ordinary task of --root (or of --queue), checked as a task file is,
    its submitter `mcp:<client name>`; a worker runs it (`fila worker` beside the server). Every
    argument is checked as hostile input: targets inside the project and not denied, only the
    policies allowed here, the policy's limits and sizes; at most --max-live-tasks of this
    server's tasks queued or running at once.
    """
    from ..api.client import Client
    from ..core.errors import InvalidInput
    from ..mcp.server import DEFAULT_POLICIES, Settings, build
    from ..queue.policy import load_policy

    client = Client(root, queue=queue_url)
    client.root.require()
    allowed = frozenset(policy) if policy else DEFAULT_POLICIES
    for name in sorted(allowed):
        load_policy(client.root, name)  # a policy that does not load is refused now
    if decide_any and not allow_decide:
        raise InvalidInput("--decide-any widens --allow-decide", hint="give both, or neither")
    settings = Settings(policies=allowed, allow_decide=allow_decide, decide_any=decide_any,
                        max_live=max_live_tasks)  # fmt: skip
    server = build(client, settings)
    try:
        if http is None:
            server.run("stdio")
            return
        from ..mcp.http import parse_bind, serve, the_token

        host, port = parse_bind(http)
        token, made = the_token(client.root, token_file, os.environ.get("FILA_MCP_TOKEN"))
        if made is not None:
            typer.echo(f"fila mcp: the bearer token is in {made} (mode 0600): clients send "
                       "`Authorization: Bearer <its content>`", err=True)  # fmt: skip

        url = f"http://{http}/mcp"

        def listening() -> None:
            typer.echo(f"fila mcp: serving {url} (root {client.root.path})", err=True)

        serve(server, host, port, token, listening)
    finally:
        client.close()
