"""Signed provenance (docs/provenance.md): `fila keys init|trust|ls` and `fila verify`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core.layout import Root
from .common import JsonOpt, QueueOpt, RootOpt, print_json, safe

if TYPE_CHECKING:
    from ..provenance.verify import Evidence, Verdict

NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name", help="what the key is called in the trusted set (default: user@host)", show_default=False
    ),
]


def keys_init(
    root: RootOpt = None, queue_url: QueueOpt = None, name: NameOpt = None, json_: JsonOpt = False
) -> None:
    """Make this root's ed25519 signing key, once, and trust it.

    The private key is written 0600 to fila/keys/signing.pem under the root and never leaves
    it; its public half goes to fila/keys/signing.pub.json and into the trusted set: the root's
    (fila/keys/trusted.json), and with --queue the queue database's. A runner host runs this in
    its own root: the run statements of the tasks it runs are then signed with its key. Run
    again, it keeps the key and trusts it where it is not yet trusted."""
    from ..provenance import keys

    r = Root.at(root).require()
    key, made = keys.init(r, name=name)
    added = _trust_in_queue(queue_url, key, name) if queue_url else None
    pub = keys.keys_dir(r) / keys.PUBLIC
    if json_:
        print_json({"keyid": key.keyid, "made": made, "public_key": str(pub), "trusted_in_queue": added})
        return
    typer.echo(f"{'made' if made else 'kept'} the signing key {key.keyid} ({pub})")
    if added is not None:
        typer.echo(f"{'trusted' if added else 'already trusted'} in the queue database")


def _trust_in_queue(url: str, key: Any, name: str | None) -> bool:
    from ..provenance import keys
    from ..queue.pg.store import PgQueue

    who = name or keys.default_name()
    with PgQueue(url) as db:
        return db.trust_key(key.keyid, who, keys.public_dict(key), by=keys.default_name())


def keys_trust(
    public_key: Annotated[
        Path, typer.Argument(help="a public key file (signing.pub.json of the signer's root)")
    ],
    root: RootOpt = None,
    queue_url: QueueOpt = None,
    name: NameOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Trust another host's public key: a runner's, whose run statements then verify, or a
    reviewer's, whose decisions do. Without --queue the root's trusted set; with it, the queue
    database's."""
    from ..provenance import keys

    key = keys.read_public(public_key)
    who = name or str(public_key)
    if queue_url:
        added = _trust_in_queue(queue_url, key, who)
    else:
        r = Root.at(root).require()
        added = key.keyid not in {k.keyid for k in keys.trusted(r)}
        keys.trust(r, key, name=who)
    if json_:
        print_json({"keyid": key.keyid, "added": added})
        return
    typer.echo(safe(f"{'trusted' if added else 'already trusted'}: {key.keyid} ({who})"))


def keys_ls(root: RootOpt = None, queue_url: QueueOpt = None, json_: JsonOpt = False) -> None:
    """List the trusted keys: the root's, or with --queue the queue database's."""
    from ..provenance import keys

    if queue_url:
        from ..queue.pg.store import PgQueue

        with PgQueue(queue_url) as db:
            found = keys.from_rows(db.trusted_rows(), where=db.where)
    else:
        found = keys.trusted(Root.at(root).require())
    if json_:
        print_json([k.to_json() for k in found])
        return
    if not found:
        typer.echo("no trusted keys (provenance is off: `fila keys init`)")
    for k in found:
        typer.echo(safe(f"{k.keyid}  {k.name}  {k.added_at or ''}".rstrip()))


def verify(
    task_id: Annotated[
        str | None, typer.Argument(help="the task (omit with --patch and --attestation)")
    ] = None,
    patch: Annotated[
        Path | None,
        typer.Option("--patch", help="a DIFF.patch to check, with no queue at hand", show_default=False),
    ] = None,
    attestation: Annotated[
        list[Path] | None,
        typer.Option(
            "--attestation",
            help="a DSSE envelope: the run statement, and the decision's (repeat)",
            show_default=False,
        ),
    ] = None,
    key: Annotated[
        list[Path] | None,
        typer.Option("--key", help="a trusted public key file, with --patch (repeat)", show_default=False),
    ] = None,
    export: Annotated[
        Path | None,
        typer.Option(
            "--export",
            help="with ID: also write DIFF.patch, the statements and the signers' public keys to this "
            "directory, for `fila verify --patch --attestation --key` where no queue is at hand",
            show_default=False,
        ),
    ] = None,
    root: RootOpt = None,
    queue_url: QueueOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Check a task's signed provenance and print what it proves.

    With ID: the task's run statement (signed where it ran) and decision statement (signed by
    who applied or rejected it) from the queue (the root's, or --queue's), each signature
    against the queue's trusted keys, DIFF.patch's bytes against the statement's subject, the
    record against what the run statement says, the statement's task against ID (a statement
    replayed for another task fails), and the decision's chain to this run. With --patch,
    --attestation and --key: the same checks on files, with no queue at hand (no record).

    Exit 0: verified; 1: not signed (the queue trusts no key); 4: something does not match
    (each mismatch is named)."""
    from ..core.errors import InvalidInput

    if patch is not None or attestation or key:
        if task_id is not None or queue_url or export or not (patch and attestation and key):
            raise InvalidInput(
                "give a task ID, or --patch, --attestation and --key together (no ID, no --queue)",
                hint="fila verify ID [--queue URL]; fila verify --patch FILE --attestation FILE --key PUB",
            )
        v = _verify_files(patch, attestation, key)
    elif task_id is None:
        raise InvalidInput(
            "no task given", hint="fila verify ID, or --patch FILE --attestation FILE --key PUB"
        )
    else:
        from ..provenance.verify import verify as check

        if queue_url:
            from ..queue.pg.store import PgQueue

            with PgQueue(queue_url) as db:
                ev = _queued_evidence(db, task_id)
        else:
            ev = _root_evidence(Root.at(root).require(), task_id)
        v = check(ev)
        if export is not None:
            _export(export, ev, v)
    _print(v, json_)


def _root_evidence(r: Root, task_id: str) -> Evidence:
    from ..provenance.sources import FileSource
    from ..queue.store import get_record
    from ..review import attested

    rec = get_record(r, task_id)
    data = None
    if rec.patch_path:
        try:
            data = (r.path / rec.patch_path).read_bytes()
        except OSError:
            data = None
    return attested.evidence(FileSource(r), rec, data)


def _queued_evidence(db: Any, task_id: str) -> Evidence:
    from ..provenance.remote import QueueSource
    from ..review import attested

    rec = db.get(task_id)
    return attested.evidence(QueueSource(db), rec, db.named_blob(task_id, "DIFF.patch"))


def _export(dest: Path, ev: Evidence, v: Verdict) -> None:
    import json

    from ..provenance import keys, store

    signers = {k.keyid: k for k in ev.trusted if k.keyid in v.signers.values()}
    public = {i: (json.dumps(keys.public_dict(k.key), indent=2) + "\n").encode() for i, k in signers.items()}
    assert ev.task_id is not None
    for p in store.export(
        dest, ev.task_id, patch=ev.patch, run=ev.run, decision=ev.decision, public_keys=public
    ):
        typer.echo(safe(f"wrote {p}"), err=True)


def _verify_files(patch: Path, attestations: list[Path], key_files: list[Path]) -> Verdict:
    from ..core.errors import InvalidInput
    from ..provenance import envelope, keys
    from ..provenance.predicate import DECISION_TYPE, RUN_TYPE
    from ..provenance.verify import Evidence, verify

    found: dict[str, bytes] = {}
    for a in attestations:
        raw = a.read_bytes()
        _env, stmt = envelope.read(raw, where=str(a))
        kind = {RUN_TYPE: "run", DECISION_TYPE: "decision"}.get(stmt.get("predicateType"))
        if kind is None or kind in found:
            raise InvalidInput(f"{a}: not a fila run or decision statement, or a second one of its kind")
        found[kind] = raw
    trusted = [keys.TrustedKey(keys.read_public(k), str(k)) for k in key_files]
    return verify(Evidence(task_id=None, run=found.get("run"), trusted=trusted, where="the --key files",
                           patch=patch.read_bytes(), decision=found.get("decision")))  # fmt: skip


def _print(v: Verdict, json_: bool) -> None:
    if json_:
        print_json(v.to_json())
    else:
        typer.echo(
            safe(f"provenance of task {v.task_id or (v.run.facts.task.id if v.run else '?')}: {v.summary()}")
        )
        if v.state == "failed" and v.proves:
            typer.echo("  what the statements say (not proven: the checks above failed):")
        if v.state != "unsigned":
            for line in v.proves:
                typer.echo(safe(f"  {line}"))
    if v.state == "failed":
        raise typer.Exit(4)
    if v.state == "unsigned":
        raise typer.Exit(1)
