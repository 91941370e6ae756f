"""The PostgreSQL queue's errors, each a branch of fila's one tree (core/errors.py), so the CLI
prints them, with their hint, and exits with the branch's code (docs/architecture.md, "The
PostgreSQL queue"). No message ever holds a password: every one names the queue by
`conninfo.describe`, which leaves it out."""

from __future__ import annotations

from ...core.errors import InfraError, InvalidInput, Refused


class QueueUnreachable(InfraError):
    """The database does not answer (no server, wrong host or port, a restart that outlasted the
    wait). Exit 3, like a container engine that does not answer: nothing was changed."""


class QueueFailed(InfraError):
    """The database answered and refused an operation for a reason another try would not change
    (a full disk, a statement timeout, a value the schema refuses): nothing of it was written."""


class QueueAuthFailed(QueueUnreachable):
    """The server answered and refused the credentials or the database name."""


class QueueUrlInvalid(InvalidInput):
    """A queue URL that is not postgresql://..., or that embeds a password."""


class SchemaMismatch(Refused):
    """The database's schema is newer than this fila knows, or older than it needs (not migrated)."""


class BlobMismatch(Refused):
    """A blob whose bytes do not hash to the sha256 it is stored or sent under."""
