"""`fila env`: a project's environment made, listed and removed (docs/environments.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import JsonOpt, RootOpt, print_json, to_stderr


def build(
    project: Annotated[
        Path | None, typer.Option(help="the project (default: the queue root)", show_default=False)
    ] = None,
    policy: Annotated[
        str, typer.Option(help="the policy whose `environment` the setup runs under")
    ] = "default",
    environment: Annotated[
        str | None,
        typer.Option(
            "--environment",
            help="the declaration, relative to the project (default: .devcontainer/devcontainer.json, "
            ".devcontainer.json or fila-environment.json, the first found)",
            show_default=False,
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", "-e", help="also layer this engine on it (repeatable)", show_default=False),
    ] = None,
    force: Annotated[bool, typer.Option(help="run the setup again even when its key exists")] = False,
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Make the project's environment now: read its declaration, run the setup once per key
    (through the gateway, to the policy's environment.allow only), commit the result, and layer
    the engines on it. Progress goes to stderr; an existing key is reused."""
    from ..core.layout import Root
    from ..env import manage
    from ..sandbox import get_backend, root_backend

    r = Root.at(root)
    backend = get_backend(root_backend(r) if r.fila.is_dir() else None)
    env = manage.build(
        r,
        (project or r.path).resolve(),
        policy=policy,
        explicit=environment,
        backend=backend,
        engines=list(dict.fromkeys(engine or [])),
        force=force,
        progress=to_stderr,
    )
    if json_:
        print_json(env.record.model_dump(mode="json"))
        return
    rec = env.record
    typer.echo(
        f"environment {rec.key[:12]} ({rec.source}): {rec.how}, image {rec.image.tag if rec.image else '-'}"
    )
    for name, ref in rec.engine_images.items():
        typer.echo(f"  {name}: {ref.tag}")


def ls(root: RootOpt = None, json_: JsonOpt = False) -> None:
    """List the environments this host's container engine holds: key, image, where declared,
    the engines layered on it, its provided volumes."""
    from ..core.layout import Root
    from ..env import manage
    from ..sandbox import get_backend, root_backend

    r = Root.at(root)
    envs = manage.listing(get_backend(root_backend(r) if r.fila.is_dir() else None))
    if json_:
        print_json(envs)
        return
    if not envs:
        typer.echo("no environments")
    for e in envs:
        tag = e["image"]["tag"] if e["image"] else "(no image)"
        size = f"{e['size'] / (1 << 20):.0f} MiB" if e["size"] else "-"
        engines = ", ".join(sorted(x for x in e["engines"] if x)) or "none"
        typer.echo(f"{e['key'][:12]}  {tag}  {size}  {e['source'] or '-'}  engines: {engines}  "
                   f"volumes: {len(e['volumes'])}")  # fmt: skip


def rm(
    key: Annotated[str, typer.Argument(help="the environment's key, or its first characters (6 or more)")],
    root: RootOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove an environment: its image, its engine layers and its volumes (one a running job
    still mounts stays)."""
    from ..core.layout import Root
    from ..env import manage
    from ..sandbox import get_backend, root_backend

    r = Root.at(root)
    removed = manage.remove(r, get_backend(root_backend(r) if r.fila.is_dir() else None), key)
    if json_:
        print_json({"removed": removed})
        return
    for name in removed:
        typer.echo(f"removed {name}")


def gc(root: RootOpt = None, json_: JsonOpt = False) -> None:
    """Remove the environments that no queued, running or needs_review task of this root names."""
    from ..core.layout import Root
    from ..env import manage
    from ..sandbox import get_backend, root_backend

    r = Root.at(root)
    gone = manage.gc(r, get_backend(root_backend(r) if r.fila.is_dir() else None))
    if json_:
        print_json({"removed": gone})
        return
    typer.echo(f"removed {len(gone)} environment(s)" + "".join(f"\n  {k[:12]}" for k in gone))
