"""`fila serve`: the review queue in a browser, and its accounts (`fila serve user add|ls|revoke`).
Parses, calls web/ and formats (docs/review-web.md)."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from ..core.layout import Root
from .common import JsonOpt, QueueOpt, RootOpt, print_json, safe, to_stderr


def serve(
    ctx: typer.Context,
    root: RootOpt = None,
    queue_url: QueueOpt = None,
    bind: Annotated[
        str,
        typer.Option(
            "--bind",
            help="HOST:PORT to listen on; an address beyond loopback is refused until an account exists",
        ),
    ] = "127.0.0.1:8765",
    tls_cert: Annotated[
        str | None,
        typer.Option("--tls-cert", help="serve HTTPS with this certificate (PEM)", show_default=False),
    ] = None,
    tls_key: Annotated[
        str | None, typer.Option("--tls-key", help="the certificate's private key (PEM)", show_default=False)
    ] = None,
    public_origin: Annotated[
        str | None,
        typer.Option(
            "--public-origin",
            help="the https://HOST[:PORT] browsers reach it at through a TLS proxy (needs an account): "
            "accepted as Host and Origin; the cookie is then Secure and __Host-, and HSTS is sent",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the review queue in a browser: the list of tasks (needs_review first, filters, live),
    each task's review (summary, warnings, attempts, check, egress, the diff per file, the log),
    and the decisions (apply, reject, retry) through the code `fila apply`, `reject` and `retry`
    run, recorded by the account's name.

    It binds 127.0.0.1:8765 by default; there, without accounts, it prints a one-time login link
    whose secret makes the session of the person running it (any other local user or process
    gets nothing without it). Any other address is refused until an account exists (`fila serve
    user add NAME`); then every page needs a login (name and token), sessions are cookies
    (HttpOnly, SameSite=Strict, Secure over TLS), every form carries a one-use CSRF token and is
    refused from another origin.
    --queue: a PostgreSQL queue, applied into --root as `fila apply --queue` does; accounts live
    under --root for both queue kinds.
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..web.server import parse_bind, server

    r = Root.at(root).require()
    where = parse_bind(bind)
    with contextlib.ExitStack() as stack:
        db = None
        if queue_url:
            from ..queue.pg.store import PgQueue

            db = stack.enter_context(PgQueue(queue_url))
        srv, first = server(r, db, where, certfile=tls_cert, keyfile=tls_key, public_origin=public_origin)
        if not where.loopback and tls_cert is None and not (public_origin or "").startswith("https://"):
            to_stderr(
                f"fila: warning: serving {where.host} without TLS: tokens and cookies cross the network "
                "in clear (--tls-cert, --tls-key, or a TLS proxy in front)"
            )
        queue = db.where if db is not None else str(r.path)
        url = where.url(tls_cert is not None)
        to_stderr(f"fila serve: {url} ({'PostgreSQL queue' if db else 'file queue'} {queue}); Ctrl-C stops")
        if first != "/":
            to_stderr(
                f"fila serve: no accounts: open {url.rstrip('/')}{first} to log in as "
                "yourself (one use; the link is the secret)"
            )
        srv.run()


NameArg = Annotated[str, typer.Argument(help="the account's name (A-Z a-z 0-9 . _ -)")]


def user_add(
    name: NameArg,
    role: Annotated[
        str, typer.Option("--role", help="reviewer (decides) or reader (sees only)")
    ] = "reviewer",
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Add an account and print its token, once: only its sha256 is stored (under --root, in
    fila/web/accounts.json). The person logs in with the name and the token."""
    from ..web.accounts import add

    acct, token = add(Root.at(root), name, role)
    if json_:
        print_json({**acct.public(), "token": token})
        return
    typer.echo(token)
    to_stderr(f"fila: account {acct.name} ({acct.role}) added; the token above is shown once")


def user_ls(root: RootOpt = None, json_: JsonOpt = False) -> None:
    """List the accounts: name, role, when added, when revoked."""
    from ..web.accounts import load

    accounts = load(Root.at(root).require())
    if json_:
        print_json([a.public() for a in accounts.values()])
        return
    for a in accounts.values():
        state = f"revoked {a.revoked_at}" if a.revoked_at else "active"
        typer.echo(safe(f"{a.name}  {a.role}  added {a.created_at}  {state}"))


def user_revoke(name: NameArg, root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Revoke an account: its token opens nothing and its sessions end at their next request. The
    name stays listed and is not reused: decisions recorded by it keep naming that person."""
    from ..web.accounts import revoke

    acct = revoke(Root.at(root), name)
    if json_:
        print_json(acct.public())
        return
    typer.echo(safe(f"revoked {acct.name} at {acct.revoked_at}"))
