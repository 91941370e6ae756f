"""DSSE envelopes (docs/provenance.md): a statement signed, and an envelope read back from bytes
fila did not necessarily write. The signature scheme and the encoding are securesystemslib's
(`securesystemslib.dsse`), so the envelope is the standard one any DSSE verifier reads."""

from __future__ import annotations

import json
from typing import Any

from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import FormatError
from securesystemslib.signer import Signer

from ..core.errors import InvalidInput
from ..core.untrusted import parse_json

PAYLOAD_TYPE = "application/vnd.in-toto+json"
MAX_ENVELOPE = 4 << 20


class BadEnvelope(InvalidInput):
    """An envelope or its statement that does not read."""


def sign(statement: dict[str, Any], signer: Signer) -> bytes:
    """The statement in a DSSE envelope signed by `signer`, as the JSON bytes fila stores."""
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    env = Envelope(payload, PAYLOAD_TYPE, {})
    env.sign(signer)
    return (json.dumps(env.to_dict(), indent=2) + "\n").encode()


def read(raw: bytes, *, where: str) -> tuple[Envelope, dict[str, Any]]:
    """(the envelope, its statement) from bytes anyone may have written; BadEnvelope naming
    what does not read. The signatures are not checked here (verify.py does)."""
    if len(raw) > MAX_ENVELOPE:
        raise BadEnvelope(f"{where} is {len(raw)} bytes, over the {MAX_ENVELOPE} an envelope may have")
    doc = parse_json(raw, kind="attestation", error=BadEnvelope, path=where)
    if not isinstance(doc, dict) or not isinstance(doc.get("signatures"), list):
        raise BadEnvelope(f"{where} is not a DSSE envelope (payload, payloadType, signatures)")
    try:
        env = Envelope.from_dict(doc)
    except (KeyError, ValueError, TypeError, FormatError) as e:
        raise BadEnvelope(f"{where} is not a DSSE envelope: {e!r}") from None
    if env.payload_type != PAYLOAD_TYPE:
        raise BadEnvelope(f"{where} carries {env.payload_type!r}, not an in-toto statement ({PAYLOAD_TYPE})")
    statement = parse_json(env.payload, kind="statement", error=BadEnvelope, path=where)
    if not isinstance(statement, dict):
        raise BadEnvelope(f"the statement in {where} is not a JSON object")
    return env, statement
