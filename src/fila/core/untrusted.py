"""The one reader for JSON that fila did not write: task files in fila/in/, `fila submit FILE|-`,
policy files. Whoever writes them may have fewer rights than fila and may be hostile.

Reading never blocks and never follows a link: the entry is lstat'ed first (a FIFO, socket,
device, directory or symlink is refused without being opened), opened with O_NOFOLLOW|O_NONBLOCK,
re-checked on the open descriptor (the same regular file), and read up to a cap. Parsing refuses
what Python's json accepts but nothing downstream can hold: NaN/Infinity, floats that overflow to
infinity, integers longer than MAX_INT_DIGITS, nesting deeper than MAX_DEPTH, duplicate keys,
NUL and lone surrogates in any string. Names and paths (ids, targets, images...) must also be
free of control and bidi characters: they end up in file names, argv and terminals.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import InvalidInput

MAX_TASK_BYTES = 1 << 20  # a task is a prompt and a few names: 1 MiB is generous
MAX_POLICY_BYTES = 1 << 20
MAX_DEPTH = 32  # tasks and policies nest 3 levels; the cap keeps every recursive reader safe
MAX_INT_DIGITS = 30  # sizes and milliseconds fit easily; int('9' * 5000) raises since 3.11
# Bidi overrides and isolates, and marks that reorder text: they make a name read differently
# in a terminal or a review than the bytes it is (Trojan Source, CVE-2021-42574).
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def entry_kind(mode: int) -> str:
    """What a non-regular directory entry is, for messages."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_capped(path: Path, *, cap: int, kind: str, error: type[InvalidInput]) -> bytes:
    """The bytes of a regular file, at most `cap` of them, without ever blocking or following
    a link. Anything else raises `error` naming what the entry is and the limit."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise error(f"{kind} file not found", path=path) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise error(f"cannot look at the {kind} file: {e}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"the {kind} file is {entry_kind(st.st_mode)}, not a regular file; it was not opened",
            path=path,
            hint=f"write the {kind} as a plain JSON file",
        )
    if st.st_size > cap:
        raise error(f"the {kind} file is {st.st_size} bytes, above the {cap}-byte limit", path=path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # ELOOP: swapped for a symlink since the lstat; EACCES; ENXIO
        raise error(f"cannot open the {kind} file: {e.strerror}", path=path) from None
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise error(f"the {kind} file was replaced while it was opened; it was not read", path=path)
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise error(f"cannot read the {kind} file: {e.strerror}", path=path) from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > cap:
        raise error(f"the {kind} file is above the {cap}-byte limit", path=path)
    return raw


class _Refused(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"integer of {len(text)} digits is above the {MAX_INT_DIGITS}-digit limit")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k!r} appears twice")
        out[k] = v
    return out


def _check_tree(data: Any) -> None:
    """Depth and strings, without recursion (the document may be as deep as json allowed)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels")
            for k, v in node.items():
                _check_string(k, f"{where}{k!r}")
                stack.append((v, depth + 1, f"{where}{k}."))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1, f"{where}{i}.") for i, v in enumerate(node))
        elif isinstance(node, str):
            _check_string(node, where.rstrip(".") or "the document")


def _check_string(value: str, where: str) -> None:
    if "\x00" in value:
        raise _Refused(f"a NUL character in {where}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused(f"a lone surrogate (\\ud800-\\udfff) in {where}") from None


def bounded(value: Any, *, levels: int = MAX_DEPTH) -> Any:
    """A copy of JSON-like data that every reader here accepts again (parse_json's limits), for
    data read from an engine's own output before it goes into a record: a number past
    MAX_INT_DIGITS digits, a non-finite float and a list or object nested more than `levels`
    deep become None; strings (keys too) lose NUL characters and have lone surrogates replaced.
    A record holding the engine's words unbounded would be written, then refused by every
    reader of it. `levels`: what is left of MAX_DEPTH where the value will sit."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 10**MAX_INT_DIGITS else None
    if isinstance(value, float):  # PostgreSQL's jsonb prints 1e30 with its 31 digits: bounded as one
        return value if math.isfinite(value) and abs(value) < 10**MAX_INT_DIGITS else None
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")
    if levels < 1:
        return None
    if isinstance(value, dict):
        return {bounded(str(k)): bounded(v, levels=levels - 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [bounded(v, levels=levels - 1) for v in value]
    return None


def parse_json(raw: bytes, *, kind: str, error: type[InvalidInput], path: Path | str | None) -> Any:
    """Decode untrusted JSON bytes; `error` names what is wrong (never a traceback)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"the {kind} file is not UTF-8 (byte {e.start})", path=path) from None
    try:
        data = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_float,
            parse_int=_int,
            object_pairs_hook=_object,
        )
        _check_tree(data)
    except json.JSONDecodeError as e:
        raise error(f"malformed JSON: {e}", path=path) from None
    except _Refused as e:
        raise error(f"refused JSON: {e}", path=path) from None
    except RecursionError:
        raise error(f"refused JSON: nesting deeper than {MAX_DEPTH} levels", path=path) from None
    return data


def read_json(path: Path, *, kind: str, cap: int, error: type[InvalidInput]) -> tuple[Any, bytes]:
    """(document, the exact bytes it came from) of one untrusted file."""
    raw = read_capped(path, cap=cap, kind=kind, error=error)
    return parse_json(raw, kind=kind, error=error, path=path), raw


def name_problem(value: str) -> str | None:
    """Why a string cannot be a name or a path fila passes on (file names, argv, terminals)."""
    for ch in value:
        if ch in _BIDI:
            return f"a bidi control character U+{ord(ch):04X}"
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            return f"a control character U+{ord(ch):04X}"
    return None


def check_names(fields: Iterable[tuple[str, str | None]], *, error: type[InvalidInput], **kw: Any) -> None:
    """Raise `error` naming the first (field, value) whose value is not a safe name."""
    for field, value in fields:
        if value is None:
            continue
        problem = name_problem(value)
        if problem:
            raise error(f"field '{field}' holds {problem}; names and paths may not", **kw)


def safe_name(name: str, *, limit: int = 100) -> str:
    """A file name made of [A-Za-z0-9._-] only, for an entry whose own name is hostile."""
    cleaned = _SAFE_NAME.sub("_", name).lstrip(".")[:limit]
    return cleaned or "unnamed"


# Docker's reference grammar (distribution/reference): an optional registry host[:port], path
# components of lowercase letters and digits joined by '.', '_', '__' or dashes, an optional tag,
# an optional sha256 digest; or a bare image id. Anything else (`fila/../../x`, which reached the
# API URL as GET /x/json) is refused before Docker sees it.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]{{1,5}})?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REF = re.compile(
    rf"(?:(?:{_DOMAIN})/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?"
    r"|sha256:[0-9a-f]{64}"
)


def image_reference(value: str) -> bool:
    """Whether `value` is a Docker image reference (or an image id), by the registry's grammar."""
    name = value.partition("@")[0]
    last = name.rpartition("/")[2]
    if ":" in last:  # the tag, not a registry's port
        name = name[: len(name) - len(last) + last.index(":")]
    return len(name) <= 255 and _IMAGE_REF.fullmatch(value) is not None
