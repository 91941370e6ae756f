"""The `fila` command line. It only parses, calls the core and formats.

This module holds the app, the one error handler and the list of commands; the commands live by
role in `tasks` (submit, run, worker), `review` (the gate), `upkeep` (recovery, status, doctor,
gc), `prepare` (init, images, schema), `policy` (policy suggest) and `provenance` (keys,
verify), with what they share in `common` and the lazy build in `lazy` (docs/architecture.md,
layers).

Errors are caught in one place (`_Group.invoke`, below): a `FilaError` prints what failed and what to do
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
from typing import Any

import typer
from typer.core import TyperGroup

from ..core.errors import EXIT_INTERRUPTED, FilaError
from . import agents, env, policy, prepare, provenance, review, serve, tasks, upkeep
from .common import safe
from .lazy import Commands, lazy_command


class _Group(TyperGroup):
    _listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(self.commands)  # typer's order, without building every command to list names

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        if self._listing and isinstance(self.commands, Commands) and cmd_name in self.commands:
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
            typer.echo(f"fila: error: {safe(str(e))}", err=True)
            if e.hint:
                typer.echo(f"fila: hint: {safe(e.hint)}", err=True)
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


def _sub_group(name: str, help: str) -> typer.Typer:
    """A command group under `fila` (`fila images ...`), with the app's settings."""
    sub = typer.Typer(cls=_Group, help=help, no_args_is_help=True, rich_markup_mode=None)
    app.add_typer(sub, name=name)
    return sub


images_app = _sub_group("images", "Build and list engine images.")
policy_app = _sub_group("policy", "Learn, then lock: propose a policy from what runs did.")
keys_app = _sub_group("keys", "Signing keys and the trusted set of signed provenance (docs/provenance.md).")
env_app = _sub_group(
    "env", "The project's environment: its toolchain, built once per key (docs/environments.md)."
)
serve_app = typer.Typer(
    cls=_Group,
    help=serve.serve.__doc__,
    invoke_without_command=True,
    rich_markup_mode=None,
)
user_app = typer.Typer(
    cls=_Group, help="Accounts of `fila serve`: add, ls, revoke.", no_args_is_help=True, rich_markup_mode=None
)
serve_app.add_typer(user_app, name="user")
app.add_typer(serve_app, name="serve")

# Registration order is the order `fila --help` lists the commands in.
for callback, name in (
    (prepare.init, None),
    (prepare.queue_cmd, "queue"),
    (tasks.submit, None),
    (tasks.run_cmd, "run"),
    (tasks.worker, None),
    (upkeep.recover, None),
    (upkeep.retry, None),
    (upkeep.rearm, None),
    (upkeep.status, None),
    (review.ls_cmd, "ls"),
    (review.show, None),
    (review.logs, None),
    (review.diff, None),
    (review.review, None),
    (review.apply_cmd, "apply"),
    (review.compare, None),
    (review.reject, None),
    (provenance.verify, None),
    (upkeep.gc_cmd, "gc"),
    (upkeep.doctor, None),
    (agents.mcp_cmd, "mcp"),
    (prepare.schema, None),
):
    app.command(name)(callback)
del callback, name
images_app.command("build")(prepare.images_build)
policy_app.command("suggest")(policy.suggest)
env_app.command("build")(env.build)
env_app.command("ls")(env.ls)
env_app.command("rm")(env.rm)
env_app.command("gc")(env.gc)
keys_app.command("init")(provenance.keys_init)
keys_app.command("trust")(provenance.keys_trust)
keys_app.command("ls")(provenance.keys_ls)
serve_app.callback()(serve.serve)
user_app.command("add")(serve.user_add)
user_app.command("ls")(serve.user_ls)
user_app.command("revoke")(serve.user_revoke)


def main() -> None:
    """The console script: typer's group of `app`, each command built when it runs."""
    lazy_command(app)()
