"""Signing keys and the trusted set (docs/provenance.md, "Keys").

A host's signing key is an ed25519 private key in PKCS#8 PEM at `fila/keys/signing.pem` under its
root (0600, owned by the person running fila), with its public half beside it
(`signing.pub.json`, securesystemslib's key format, which names the key by its keyid). The
trusted set says whose signatures `fila verify` and `fila apply` accept: on the file queue
`fila/keys/trusted.json` under the root; on a PostgreSQL queue the `fila_trusted_keys` table
(queue/pg/keys.py). Keys and signatures are securesystemslib's, so any DSSE verifier that reads
its key format checks the same envelopes.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import fsutil
from ..core.errors import InvalidInput, Refused
from ..core.layout import Root
from ..core.models import now_iso
from ..core.untrusted import parse_json, read_capped

if TYPE_CHECKING:  # securesystemslib is imported where a key is read or made: a run without
    # a signing key never pays its import (docs/benchmarks.md, "The one-shot path")
    from securesystemslib.signer import CryptoSigner, SSlibKey

KEYS_DIR = "keys"
PRIVATE = "signing.pem"
PUBLIC = "signing.pub.json"
TRUSTED = "trusted.json"
MAX_KEY_FILE = 64 << 10


class BadKey(InvalidInput):
    """A key file that does not read as an ed25519 key fila can use."""


@dataclass(frozen=True)
class TrustedKey:
    """One public key whose signatures are accepted, with the name it was trusted under."""

    key: SSlibKey
    name: str
    added_at: str | None = None

    @property
    def keyid(self) -> str:
        return self.key.keyid

    def to_json(self) -> dict[str, Any]:
        return {
            "keyid": self.keyid,
            "name": self.name,
            "added_at": self.added_at,
            "key": public_dict(self.key),
        }


def keys_dir(root: Root) -> Path:
    return root.fila / KEYS_DIR


def public_dict(key: SSlibKey) -> dict[str, Any]:
    """The public key as securesystemslib writes it, with its keyid."""
    return {"keyid": key.keyid, **key.to_dict()}


def public_from(doc: Any, *, where: str) -> SSlibKey:
    """An ed25519 public key from its securesystemslib form; its keyid is computed, never taken
    from the file (a keyid that does not match its key is refused)."""
    if not isinstance(doc, dict):
        raise BadKey(f"{where} is not a public key (a JSON object is expected)")
    body = {k: v for k, v in doc.items() if k != "keyid"}
    try:
        from securesystemslib.signer import SSlibKey

        key = SSlibKey.from_dict(_keyid(body), dict(body))
    except (KeyError, ValueError, TypeError) as e:
        raise BadKey(f"{where} is not a public key fila reads: {e}") from None
    if (key.keytype, key.scheme) != ("ed25519", "ed25519"):
        raise BadKey(f"{where} is a {key.keytype}/{key.scheme} key; fila signs and trusts ed25519 keys only")
    stated = doc.get("keyid")
    if stated is not None and stated != key.keyid:
        raise BadKey(f"{where} states keyid {stated}, but its key's keyid is {key.keyid}")
    return key


def _keyid(body: dict[str, Any]) -> str:
    """securesystemslib's default keyid: the sha256 of the key's canonical JSON."""
    import hashlib

    from securesystemslib.formats import encode_canonical

    canonical = encode_canonical({k: body[k] for k in ("keytype", "scheme", "keyval")})
    assert isinstance(canonical, str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_public(path: Path) -> SSlibKey:
    raw = read_capped(path, cap=MAX_KEY_FILE, kind="public key", error=BadKey)
    return public_from(parse_json(raw, kind="public key", error=BadKey, path=path), where=str(path))


def init(root: Root, *, name: str | None = None) -> tuple[SSlibKey, bool]:
    """This root's signing key, made when it has none: (its public key, made now). The private
    half is written 0600 and never replaced; the public key is added to the root's trusted set
    under `name` (default: user@host)."""
    d = keys_dir(root)
    d.mkdir(mode=0o700, exist_ok=True)
    made = False
    if not (d / PRIVATE).exists():
        from securesystemslib.signer import CryptoSigner

        signer = CryptoSigner.generate_ed25519()
        made = fsutil.create_exclusive(d / PRIVATE, signer.private_bytes, mode=0o600)
        if made:
            fsutil.atomic_write(d / PUBLIC, json.dumps(public_dict(signer.public_key), indent=2) + "\n")
    key = signer_of(root).public_key
    if made or key.keyid not in {k.keyid for k in trusted(root)}:
        trust(root, key, name=name or default_name())
    return key, made


def default_name() -> str:
    """user@host: the name a key is trusted under unless given one."""
    import getpass

    try:
        user = os.environ.get("FILA_USER") or getpass.getuser()
    except (OSError, KeyError):
        user = f"uid{os.getuid()}"
    return f"{user}@{os.uname().nodename}"


def signer_of(root: Root) -> CryptoSigner:
    """This root's signing key. NotFound-like Refused when there is none, or when its file may
    be read or written by someone else (a key others can read signs for them too)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    path = keys_dir(root) / PRIVATE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused(
            f"no signing key in {path.parent}", path=path, hint="`fila keys init` makes one"
        ) from None
    except OSError as e:
        raise Refused(f"the signing key cannot be opened: {e.strerror}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise Refused(
                f"the signing key is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}: only a regular "
                f"file of uid {os.getuid()} that no one else may read or write signs",
                path=path,
                hint=f"chmod 600 {path} (and make a new key if others could read it)",
            )
        data = f.read(MAX_KEY_FILE)
    try:
        from securesystemslib.signer import CryptoSigner

        return CryptoSigner(load_pem_private_key(data, password=None))
    except (ValueError, TypeError) as e:
        raise BadKey(f"the signing key is not an ed25519 PEM key: {e}", path=path) from None


def has_signer(root: Root) -> bool:
    return (keys_dir(root) / PRIVATE).exists()


def trusted(root: Root) -> list[TrustedKey]:
    """The file queue's trusted set (`fila/keys/trusted.json`); empty when there is none."""
    path = keys_dir(root) / TRUSTED
    try:
        raw = read_capped(path, cap=4 << 20, kind="trusted keys", error=BadKey)
    except BadKey:
        if not path.exists():
            return []
        raise
    doc = parse_json(raw, kind="trusted keys", error=BadKey, path=path)
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise BadKey("the trusted keys file has no `keys` list", path=path)
    return [from_json(e, where=f"{path} entry {i + 1}") for i, e in enumerate(entries)]


def from_json(entry: Any, *, where: str) -> TrustedKey:
    if not isinstance(entry, dict):
        raise BadKey(f"{where} is not an object")
    name = entry.get("name")
    added = entry.get("added_at")
    return TrustedKey(
        public_from(entry.get("key"), where=where),
        name if isinstance(name, str) else "",
        added if isinstance(added, str) else None,
    )


def trust(root: Root, key: SSlibKey, *, name: str) -> TrustedKey:
    """Add `key` to the file queue's trusted set (a key trusted already keeps its entry)."""
    d = keys_dir(root)
    d.mkdir(mode=0o700, exist_ok=True)
    with fsutil.file_lock(d / ".trusted.lock"):
        have = trusted(root)
        for k in have:
            if k.keyid == key.keyid:
                return k
        entry = TrustedKey(key, name, now_iso())
        doc = {"keys": [k.to_json() for k in [*have, entry]]}
        fsutil.atomic_write(d / TRUSTED, json.dumps(doc, indent=2) + "\n")
        return entry


def from_rows(rows: list[tuple[str, str, str, str]], *, where: str) -> list[TrustedKey]:
    """A PostgreSQL queue's trusted keys (PgKeys.trusted_rows) read as untrusted: each key's id is
    computed again and must be its row's."""
    out = []
    for keyid, name, text, added in rows:
        doc = parse_json(text.encode(), kind="trusted key", error=BadKey, path=where)
        key = public_from(doc, where=f"{where}, trusted key {keyid[:16]}")
        if key.keyid != keyid:
            raise BadKey(f"{where}: the trusted key row {keyid[:16]} holds key {key.keyid[:16]}")
        out.append(TrustedKey(key, name, added))
    return out
