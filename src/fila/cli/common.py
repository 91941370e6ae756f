"""What every command module of the CLI shares: the common options, and how output is printed.

Text that came from a file (a task's field, an engine's output, a name in work/) is escaped with
`safe` before it is shown: it may carry terminal escape sequences (docs/architecture.md, threat
model).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # pydantic's import costs a third of `fila --help`; commands import it lazily
    from ..core.errors import FilaError
    from ..core.models import Record

RootOpt = Annotated[
    Path | None,
    typer.Option(
        "--root", envvar="FILA_ROOT", help="queue root (default: current directory)", show_default=False
    ),
]
QueueOpt = Annotated[
    str | None,
    typer.Option(
        "--queue",
        envvar="FILA_QUEUE",
        help="a PostgreSQL queue URL (postgresql://user@host/db, no password: libpq's PGPASSWORD or "
        "~/.pgpass); default: the file queue under --root",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
ByOpt = Annotated[
    str | None,
    typer.Option("--by", help="who decides (default: $FILA_USER, else the login name)", show_default=False),
]
ReasonOpt = Annotated[str | None, typer.Option("--reason", "-m", help="why (recorded)")]


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, default=str))


def to_stderr(msg: str) -> None:
    # Progress and failures of running tasks quote their fields and errors: escaped per line.
    typer.echo("\n".join(safe(line) for line in msg.split("\n")), err=True)


def print_error(e: FilaError) -> None:
    """What failed and what to do next, on stderr, escaped line by line: a worker's own infra error
    (an error raised out of a command is the app's handler's, in the same form)."""
    to_stderr(f"fila: error: {e}" + (f"\nfila: hint: {e.hint}" if e.hint else ""))


def record_printer(json_: bool) -> Callable[[Record], None]:
    """How a worker prints each record it settles: one JSON object, or the summary line."""
    return lambda rec: typer.echo(json.dumps(record_json(rec)) if json_ else summary_line(rec))


def safe(text: str) -> str:
    """Text from the engine as it may be shown (a name can carry terminal escape sequences)."""
    from ..workspace.fswalk import inert

    return inert(text)


def summary_line(rec: Record) -> str:
    st = rec.diffstat
    diff = f"{st.files} files +{st.insertions} -{st.deletions}" if st else "no diff"
    err = f"  {rec.error.kind}: {rec.error.message}" if rec.error else ""
    total = rec.timings.get("total")
    return safe(f"{rec.id}  {rec.status}  {diff}" + (f"  {total:.1f}s" if total else "") + err)


def record_json(rec: Record) -> dict[str, Any]:
    return rec.model_dump(mode="json")
