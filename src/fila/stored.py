"""Files fila generates once and keeps beside its code (`_schemas.json` beside models.py,
`_help.py` beside entry.py), read instead of being generated again in every process.

Their key (a hash of the sources they came from) is computed from public inputs, so it says nothing
about who wrote the file: such a file is read only when it is owned like the module that reads it and
writable by no one else. Its own module (not entry.py) so that models.py can use it without an
import circle through the CLI; it imports only os and stat.
"""

from __future__ import annotations

import os
import stat


def stored_bytes(path: str, module: str) -> bytes | None:
    """The bytes of a generated file kept beside `module` (the module that reads it), or None when
    it is not to be trusted: not a regular file (a symlink is not followed), owned by another uid
    than `module`, or writable by group or others. Whoever could write such a file would choose what
    fila prints or validates against (its key is computed from public sources), so it is ignored,
    as a stale one is. The checks are on the open descriptor: the file read is the file checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid != os.stat(module).st_uid:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
