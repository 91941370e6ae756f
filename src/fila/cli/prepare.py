"""What a queue needs before a task runs: `fila init`, `fila queue init` (the PostgreSQL queue),
`fila images build`, `fila schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..core.layout import Root
from .common import JsonOpt, RootOpt, print_json, to_stderr


def init(
    root: RootOpt = None,
    backend: Annotated[
        str | None,
        typer.Option(help="container backend of this root: docker (default) or podman (rootless)"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Create the queue layout (fila/in, out, logs; sandbox/; policies/) in the root."""
    from ..queue.policy import install_shipped
    from ..sandbox import check_name, set_root_backend

    r = Root.at(root)
    if backend is not None:
        check_name(backend)  # before anything is created
    copied = install_shipped(r.create())
    if backend is not None:
        set_root_backend(r, backend)
    if json_:
        print_json({"root": str(r.path), "policies_installed": copied, "backend": backend})
        return
    typer.echo(f"initialised fila queue in {r.path}" + (f" (backend {backend})" if backend else ""))
    if copied:
        typer.echo(f"policies installed: {', '.join(copied)} (in {r.policies_dir})")


def schema(
    kind: Annotated[str, typer.Argument(help="task, policy, record, environment or provenance")],
    root: RootOpt = None,
) -> None:
    """Print the JSON Schema of a file format (the one fila validates against); provenance: the
    predicates of fila's signed statements (docs/provenance.md). The formats are fila's, not a
    queue root's: --root is accepted, like every command's, and changes nothing."""
    from ..core.errors import InvalidInput

    if kind == "provenance":
        from ..provenance.predicate import schema as provenance_schema

        typer.echo(json.dumps(provenance_schema(), indent=2))
        return
    from ..core.models import schema_for

    if kind == "environment":  # fila-environment.json (docs/environments.md)
        from ..env.spec import EnvSpec

        typer.echo(json.dumps(EnvSpec.model_json_schema(), indent=2))
        return
    if kind not in ("task", "policy", "record"):
        raise InvalidInput(
            f"unknown schema {kind!r}", hint="choose task, policy, record, environment or provenance"
        )
    typer.echo(json.dumps(schema_for(kind), indent=2))


def images_build(
    engine: Annotated[
        list[str] | None,
        typer.Argument(
            help="engines, or support images: gateway, testnet, testenv, pkgindex (default: every engine)",
            show_default=False,
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
    from ..engines import engine_names, get_engine
    from ..sandbox import get_backend, root_backend
    from ..sandbox.images import SUPPORT_IMAGES

    names = list(dict.fromkeys(engine)) if engine else engine_names()
    for name in names:
        if name not in SUPPORT_IMAGES:
            get_engine(name)  # an unknown name lists the valid engines, before anything is built
    built = []
    r = Root.at(root)
    backend = get_backend(root_backend(r) if r.fila.is_dir() else None)
    for name in names:
        ref = backend.build(
            name, base=base, ca_file=ca_file, force=force, progress=to_stderr, verbose=verbose
        )
        built.append({"engine": name, "tag": ref.tag, "id": ref.id})
        if not json_:
            typer.echo(f"{name}: {ref.tag} {ref.id}")
    if json_:
        print_json(built)


def queue_cmd(
    action: Annotated[str, typer.Argument(help="init: create the schema, or upgrade it to this fila's")],
    url: Annotated[
        str,
        typer.Option(
            "--queue",
            envvar="FILA_QUEUE",
            help="the queue database, postgresql://USER@HOST[:PORT]/DBNAME; the password comes from "
            "PGPASSWORD, ~/.pgpass (PGPASSFILE) or a service file, never the URL",
            show_default=False,
        ),
    ],
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Create or upgrade a PostgreSQL queue's schema: `fila queue init --queue URL`.

    Runner hosts share such a queue. The schema comes from numbered migrations, each in one
    transaction, and its version is printed; a schema newer than this fila knows is refused and
    left as it is. --root is accepted, like every command's, and changes nothing."""
    from ..core.errors import InvalidInput
    from ..queue.pg import conninfo, migrate

    if action != "init":
        raise InvalidInput(f"unknown queue action {action!r}", hint="the action is init")
    before, after = migrate.migrate(url)
    where = conninfo.describe(conninfo.parse(url))
    done = "created" if before == 0 else "upgraded" if before < after else "current"
    if json_:
        print_json({"queue": where, "schema": done, "version_before": before, "version": after})
        return
    said = {
        "created": f"created the queue schema, version {after},",
        "upgraded": f"upgraded the queue schema from version {before} to {after}",
        "current": f"the queue schema is current, version {after},",
    }[done]
    typer.echo(f"{said} in {where}")
