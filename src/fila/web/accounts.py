"""Who may use `fila serve`: named accounts with a role and a token, stored hashed
(docs/review-web.md, "Accounts").

The accounts are the server's door, not the queue's: they live in the queue root `fila serve`
runs from (`fila/web/accounts.json`, mode 0600, owned by the user who runs it), for the file
queue and for a PostgreSQL queue alike (serving a PostgreSQL queue needs a root anyway: apply
lands there). A token is 32 random bytes shown once at `user add`; only its sha256 is kept (a
random token needs no slow hash: nothing can be guessed from its hash). A revoked account stays
listed with when it was revoked, and its name cannot be reused: a decision recorded by that name
keeps meaning that person.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..core import fsutil
from ..core.errors import DuplicateId, InvalidInput, NotFound
from ..core.layout import Root
from ..core.models import now_iso
from ..core.states import valid_id
from ..core.stored import NotTrusted, owned_bytes

ROLES = ("reviewer", "reader")
TOKEN_PREFIX = "fila_"


@dataclass(frozen=True)
class Account:
    name: str
    role: str
    sha256: str
    created_at: str
    revoked_at: str | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def public(self) -> dict[str, str | None]:
        """What `user ls --json` shows: everything but the token's hash."""
        return {
            "name": self.name,
            "role": self.role,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
        }


def path(root: Root) -> Path:
    return root.fila / "web" / "accounts.json"


def load(root: Root) -> dict[str, Account]:
    """The accounts by name (none when the file is missing). A file another user could have
    written is refused: whoever writes it chooses who may decide."""
    where = path(root)
    try:
        data = owned_bytes(str(where), os.getuid())
    except FileNotFoundError:
        return {}
    except (OSError, NotTrusted) as e:
        raise InvalidInput(
            f"the accounts file {where} cannot be trusted: {e}",
            hint="remove it and add the accounts again (`fila serve user add NAME`)",
        ) from None
    try:
        doc = json.loads(data)
        return {a["name"]: Account(**a) for a in doc["accounts"]}
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidInput(
            f"the accounts file {where} does not read: {e}", hint="remove it and add the accounts again"
        ) from None


def any_active(root: Root) -> bool:
    """Whether the root has an account that is not revoked (the server then needs a login)."""
    return any(a.active for a in load(root).values())


def _save(root: Root, accounts: dict[str, Account]) -> None:
    where = path(root)
    where.parent.mkdir(mode=0o700, exist_ok=True)
    doc = {"accounts": [vars(a) for a in sorted(accounts.values(), key=lambda a: a.name)]}
    fsutil.atomic_write(where, json.dumps(doc, indent=1) + "\n", mode=0o600)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def add(root: Root, name: str, role: str = "reviewer") -> tuple[Account, str]:
    """A new account and its token (shown once, never stored)."""
    if not valid_id(name):
        raise InvalidInput(
            f"invalid account name {name!r}",
            hint="names are 1-128 characters of A-Z a-z 0-9 . _ - (not '.' or '..')",
        )
    if role not in ROLES:
        raise InvalidInput(f"unknown role {role!r}", hint=f"one of: {', '.join(ROLES)}")
    root.require()
    (root.fila / "web").mkdir(mode=0o700, exist_ok=True)
    with fsutil.file_lock(root.fila / "web" / "accounts.lock", own=True, mode=0o600):
        accounts = load(root)
        if name in accounts:
            was = accounts[name]
            raise DuplicateId(
                f"account {name!r} exists" + (f" (revoked at {was.revoked_at})" if was.revoked_at else ""),
                hint="choose another name; a revoked name is not reused",
            )
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        acct = Account(name=name, role=role, sha256=_hash(token), created_at=now_iso())
        _save(root, {**accounts, name: acct})
    return acct, token


def revoke(root: Root, name: str) -> Account:
    """The account revoked: its token opens nothing from now on, its sessions end."""
    root.require()
    if not (root.fila / "web").is_dir():
        raise NotFound(f"no account {name!r}: {path(root)} does not exist", hint="`fila serve user add NAME`")
    with fsutil.file_lock(root.fila / "web" / "accounts.lock", own=True, mode=0o600):
        accounts = load(root)
        acct = accounts.get(name)
        if acct is None:
            raise NotFound(f"no account {name!r} in {path(root)}", hint="`fila serve user ls` lists them")
        if acct.revoked_at is None:
            acct = Account(**{**vars(acct), "revoked_at": now_iso()})
            _save(root, {**accounts, name: acct})
    return acct


def check(accounts: dict[str, Account], name: str, token: str) -> Account | None:
    """The active account `name` whose token is `token`, else None (the comparison takes the same
    time whether the name exists or not)."""
    acct = accounts.get(name)
    want = acct.sha256 if acct is not None else "0" * 64
    ok = hmac.compare_digest(_hash(token), want)
    return acct if ok and acct is not None and acct.active else None
