"""Files fila keeps for itself and reads back instead of doing the work again: `_schemas.json`
beside core/models/schema.py and `_help.py` beside entry.py (generated once), recovery's cache in fila/state/.

What such a file says is not checked by its content (a generated file's key is a hash of public
sources; a cache is only a hint), so it is read only when it is owned by the uid that should have
written it and writable by no one else: `owned_bytes`. Its own module (not entry.py) so that
core/models/schema.py and recovery can use it without an import circle; it imports only os and stat.
"""

from __future__ import annotations

import errno
import os
import stat


class NotTrusted(Exception):
    """The file is there but not to be trusted; str() says why (for a report)."""


def owned_bytes(path: str, uid: int, *, private: bool = False) -> bytes:
    """The bytes of the regular file at `path` when it is owned by `uid` and writable by neither
    group nor others (with `private`, not readable by them either: a secret); a symlink is not
    followed. Raises NotTrusted (why) otherwise, and OSError
    (FileNotFoundError among them) when it cannot be read. The checks are on the open descriptor:
    the file read is the file checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink planted at its name
            raise NotTrusted(f"it cannot be opened without following a link ({e.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotTrusted("it is not a regular file")
        if st.st_uid != uid or st.st_mode & (0o077 if private else 0o022):
            raise NotTrusted(
                f"it is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: only uid {uid}'s, "
                f"{'readable' if private else 'writable'} by no one else, is trusted"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def stored_bytes(path: str, module: str) -> bytes | None:
    """The bytes of a generated file kept beside `module` (the module that reads it), or None when
    it is missing, unreadable or not to be trusted: owned by another uid than `module`, writable by
    group or others, not a regular file. Whoever could write such a file would choose what fila
    prints or validates against, so it is ignored, as a stale one is."""
    try:
        return owned_bytes(path, os.stat(module).st_uid)
    except (OSError, NotTrusted):
        return None
