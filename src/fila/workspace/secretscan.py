"""The credentials fila knows for a run, found and replaced in whatever fila shows or applies.

A route's real key lives in the gateway and an engine's forwarded secrets in its container; an
upstream that echoes the key, or an engine that saves what it was told, can carry one into work/
and from there into DIFF.patch, REVIEW.html, the record and the project. Every such text passes
through one `Scanner`: it looks for each value in the forms it usually travels in, so an encoded
copy is caught as surely as the plain one. Each character of the value may stand
- as itself (UTF-8), or with its bytes percent-encoded (either case of hex, `+` for a space);
- JSON-escaped (`\\uXXXX` in either case, or `\\/`, `\\"`, `\\\\`, `\\n`...);
- git's C quoting of a path (`\\303\\251`), the form file names take in DIFF.patch;
in any mixture, so a value escaped in part is found too. And the value may stand as base64,
standard or URL-safe, at each of the 3 byte alignments (only the characters that depend on the
value alone, so it is found inside a longer encoded text), with line breaks anywhere (MIME and
`base64` wrap at 76 columns) and `/` or `+` percent- or JSON-escaped. A value with white space at
either end is also looked for trimmed: the gateway sends the trimmed key.

A value shorter than MIN_CHARS is not looked for: it is no credential a route or an engine uses,
and it would match ordinary text (a 3-character value masks every word that contains it, half a
diff). Such a value is reported by label (`Scanner.skipped`) so the record can say so.

Never a value in what the scanner reports: labels ("route anthropic", "engine variable
ANTHROPIC_API_KEY") name the credential, counts say how often it was found.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import functools
import json
import os
import re
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from ..core.models import Policy

MIN_CHARS = 8
_CHUNK = 1 << 20
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Credential:
    label: str  # how the record and the marker name it; never the value
    value: str


def known(
    policy: Policy, *, engine_vars: Mapping[str, str] | None = None, forwarded: Iterable[str] = ()
) -> list[Credential]:
    """The credentials of a run: the policy's route keys (network allowlist), the engine's
    credential variables from the host, and the values its invocation marks secret."""
    from ..core.errors import InvalidPolicy
    from ..egress import config as egress

    out: list[Credential] = []
    if policy.network == "allowlist":
        # A credential that cannot be read starts no gateway: the engine never runs with it.
        with contextlib.suppress(InvalidPolicy, OSError, UnicodeDecodeError):
            out += [
                Credential(f"route {r.name}", form)
                for r in egress.resolve_routes(policy)
                for form in egress.credential_forms(r.format, r.key)
            ]
    for name, route in policy.environment.routes.items():
        # A setup route's token never reaches a job (docs/environments.md): should it ever, it is
        # still kept out of what fila shows or applies.
        with contextlib.suppress(InvalidPolicy, OSError, UnicodeDecodeError):
            key = egress.read_credential(name, route)
            forms = egress.credential_forms(egress.route_shape(name, route)[2], key)
            out += [Credential(f"setup route {name}", form) for form in forms]
    out += [Credential(f"engine variable {k}", v) for k, v in (engine_vars or {}).items()]
    out += [Credential("engine secret", v) for v in forwarded]
    return out


def encodings(value: str) -> list[bytes]:
    """The canonical byte strings that betray `value`: itself, its base64 cores, its full
    percent-encoding and JSON escape, longest first. `pattern` finds these and their variants."""
    raw = value.encode("utf-8", "surrogateescape")
    forms = {raw, *_base64_cores(raw)}
    for safe in ("", "/"):
        for quoted in (urllib.parse.quote(raw, safe=safe), urllib.parse.quote_plus(raw, safe=safe)):
            forms.add(quoted.encode())
    with contextlib.suppress(UnicodeEncodeError):  # a lone surrogate: no JSON text holds it
        forms.add(json.dumps(value, ensure_ascii=True)[1:-1].encode())
    return sorted((f for f in forms if f), key=lambda f: (-len(f), f))


def _base64_cores(raw: bytes) -> set[bytes]:
    cores = set()
    for b64 in (base64.b64encode, base64.urlsafe_b64encode):
        for k in range(3):
            # After k leading bytes the value's bits start at 8k: the characters wholly inside
            # [8k, 8k + 8n) depend on the value alone, whatever surrounds it.
            full = b64(b"\0" * k + raw)
            cores.add(full[-(-8 * k // 6) : (8 * k + 8 * len(raw)) // 6])
    return {c for c in cores if c}


def _hex(n: int, width: int) -> set[bytes]:
    """`n` in hex, in every mixture of letter case."""
    out = {b""}
    for c in f"{n:0{width}x}":
        out = {o + v.encode() for o in out for v in {c.lower(), c.upper()}}
    return out


_SHORT_ESCAPES = {'"': b'\\"', "\\": b"\\\\", "/": b"\\/", "\b": b"\\b", "\f": b"\\f",
                  "\n": b"\\n", "\r": b"\\r", "\t": b"\\t", "\a": b"\\a", "\v": b"\\v"}  # fmt: skip

# A form is a sequence of tokens; a token is the set of byte strings one character may take.
Form = list[frozenset[bytes]]


def _char(ch: str) -> frozenset[bytes]:
    """Every form of one character of a value that the module doc lists."""
    data = ch.encode("utf-8", "surrogateescape")
    each = {b""}
    for b in data:
        one = {bytes([b]), b"\\" + f"{b:03o}".encode()} | {b"%" + h for h in _hex(b, 2)}
        each = {e + o for e in each for o in one}
    cp = ord(ch)
    if cp < 0x10000:
        each |= {b"\\u" + h for h in _hex(cp, 4)}
    else:
        hi, lo = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
        each |= {b"\\u" + a + b"\\u" + z for a in _hex(hi, 4) for z in _hex(lo, 4)}
    if ch in _SHORT_ESCAPES:
        each.add(_SHORT_ESCAPES[ch])
    if ch == " ":
        each.add(b"+")
    return frozenset(each)


_B64_ESCAPES = {ord("+"): {b"+", b"%2b", b"%2B"}, ord("/"): {b"/", b"%2f", b"%2F", b"\\/"}}
_WRAPS = (b"", b"\n", b"\r\n")  # base64 wrapped at any column (MIME, `base64`)


def forms(value: str) -> list[Form]:
    """The value character by character, and each base64 core with a line break allowed before
    any character but the first (module doc)."""
    raw = value.encode("utf-8", "surrogateescape")
    out: list[Form] = [[_char(ch) for ch in value]]
    for core in sorted(_base64_cores(raw)):
        chars = [_B64_ESCAPES.get(c, {bytes([c])}) for c in core]
        out.append(
            [frozenset(chars[0])] + [frozenset(w + x for w in _WRAPS for x in alts) for alts in chars[1:]]
        )
    return out


def _regex(form: Form) -> bytes:
    return b"".join(
        b"(?:" + b"|".join(re.escape(x) for x in sorted(tok, key=lambda x: (-len(x), x))) + b")"
        for tok in form
    )


def _may_begin(data: bytes, form: Form, i: int = 0) -> bool:
    """Could `data` be the beginning of a match of `form` from its token `i` on?"""
    if not data or i == len(form):
        return not data
    for alt in form[i]:
        if alt.startswith(data):
            return True
        if data.startswith(alt) and _may_begin(data[len(alt) :], form, i + 1):
            return True
    return False


def marker(label: str) -> bytes:
    """What replaces a credential in DIFF.patch and the record: fixed per label, so the same work/
    gives the same patch bytes and sha256."""
    return f"[fila: credential removed: {label}]".encode()


def counted(counts: Mapping[str, int]) -> str:
    """`route anthropic: 3, engine secret: 1`: what a warning says of what was found."""
    return ", ".join(f"{label}: {n}" for label, n in sorted(counts.items()))


ALLOW_FLAG = "--allow-credential"


def diff_warning(counts: Mapping[str, int], files: int) -> str:
    """The record's warning for credentials replaced in DIFF.patch (shown by show and review)."""
    where = f" in {files} file{'' if files == 1 else 's'}" if files else ""
    return (
        f"known credential in the engine's changes{where} ({counted(counts)}): replaced in DIFF.patch "
        f"by {marker('…').decode()}; `fila apply` refuses this task unless {ALLOW_FLAG}"
    )


class Scanner:
    """Finds and replaces the known credentials' needles (the `encodings` of each) in bytes."""

    def __init__(self, credentials: Iterable[Credential] = ()) -> None:
        labels: dict[str, list[str]] = {}
        self.skipped: list[str] = []
        for c in credentials:
            for value in dict.fromkeys((c.value, c.value.strip())):
                if not value:
                    continue
                if len(value) < MIN_CHARS:
                    if c.label not in self.skipped:
                        self.skipped.append(c.label)
                    continue
                names = labels.setdefault(value, [])
                if c.label not in names:
                    names.append(c.label)
        self.values = list(labels)  # what the log redactor looks for (backends get values only)
        # The longest value first: where one value holds another, the whole one is replaced.
        ordered = sorted(labels.items(), key=lambda kv: (-len(kv[0]), kv[0]))
        self._init([(forms(value), ", ".join(names)) for value, names in ordered])

    @classmethod
    def of_needles(cls, needles: Mapping[bytes, str]) -> Scanner:
        """A scanner for these exact byte strings (no encodings, no minimum length)."""
        s = cls.__new__(cls)
        s.skipped, s.values = [], []
        exact = sorted((n for n in needles if n), key=lambda n: (-len(n), n))
        s._init([([[frozenset({bytes([c])}) for c in n]], needles[n]) for n in exact])
        return s

    def _init(self, found_by: list[tuple[list[Form], str]]) -> None:
        self.labels = [label for _, label in found_by]
        self.forms = [f for fs, _ in found_by for f in fs]
        parts = [b"(?P<c%d>%s)" % (i, b"|".join(_regex(f) for f in fs)) for i, (fs, _) in enumerate(found_by)]
        self._rx = re.compile(b"|".join(parts)) if parts else None
        # The most bytes one match can span: how much of a stream may be held back, how far
        # chunks overlap.
        self.longest = max((sum(max(map(len, tok)) for tok in f) for f in self.forms), default=0)

    @functools.cached_property
    def first_bytes(self) -> frozenset[int]:
        """The bytes a match can begin with."""
        return frozenset(alt[0] for f in self.forms for alt in f[0] if alt)

    def may_begin(self, data: bytes) -> bool:
        """Could `data` be the beginning of a match (more bytes to come)?"""
        return any(_may_begin(data, f) for f in self.forms)

    def label_of(self, m: re.Match[bytes]) -> str:
        return self.labels[int(m.lastgroup[1:])] if m.lastgroup else ""

    def __bool__(self) -> bool:
        return self._rx is not None

    def find(self, data: bytes) -> bool:
        return self._rx is not None and self._rx.search(data) is not None

    def mask(
        self,
        data: bytes,
        counts: Counter[str] | None = None,
        replace: Callable[[str], bytes] = marker,
    ) -> bytes:
        """`data` with every needle replaced by `replace(label)`; `counts` adds one per label."""
        if self._rx is None:
            return data

        def sub(m: re.Match[bytes]) -> bytes:
            label = self.label_of(m)
            if counts is not None:
                counts[label] += 1
            return replace(label)

        return self._rx.sub(sub, data)

    def find_in_fd(self, fd: int, size: int) -> bool:
        """Does the open file hold a needle? Read in chunks that overlap by the longest needle
        less one, so one cut in two is seen whole."""
        if self._rx is None:
            return False
        from .fswalk import read_exact

        os.lseek(fd, 0, os.SEEK_SET)
        keep, tail, left = self.longest - 1, b"", size
        while left:
            chunk = tail + read_exact(fd, min(_CHUNK, left))
            left -= len(chunk) - len(tail)
            if self._rx.search(chunk):
                return True
            tail = chunk[-keep:] if keep else b""
        return False

    def scrub(self, value: _T, counts: Counter[str] | None = None) -> _T:
        """`value` with every credential in its text replaced by its marker: strings, and the
        strings inside lists, tuples, dicts, pydantic models and dataclasses (a record's error,
        warnings, engine report, egress log). What holds none is returned as it is."""
        if self._rx is None:
            return value
        return self._scrub(value, counts)

    def _scrub(self, v: Any, counts: Counter[str] | None) -> Any:
        if isinstance(v, enum.Enum) or v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, str):
            raw = v.encode("utf-8", "surrogateescape")
            out = self.mask(raw, counts)
            return v if out is raw or out == raw else out.decode("utf-8", "surrogateescape")
        if isinstance(v, bytes):
            return self.mask(v, counts)
        if isinstance(v, list | tuple):
            items = [self._scrub(x, counts) for x in v]
            return v if all(a is b for a, b in zip(items, v, strict=True)) else type(v)(items)
        if isinstance(v, dict):
            pairs = [(self._scrub(k, counts), self._scrub(x, counts)) for k, x in v.items()]
            same = all(a is k and b is x for (a, b), (k, x) in zip(pairs, v.items(), strict=True))
            return v if same else dict(pairs)
        if isinstance(v, BaseModel):
            data = {**{f: getattr(v, f) for f in type(v).model_fields}, **(v.__pydantic_extra__ or {})}
            changed = {k: new for k, x in data.items() if (new := self._scrub(x, counts)) is not x}
            return v.model_copy(update=changed) if changed else v
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.init}
            changed = {k: new for k, x in fields.items() if (new := self._scrub(x, counts)) is not x}
            return dataclasses.replace(v, **changed) if changed else v
        return v

    def stream(self, replace: Callable[[str], bytes] = marker) -> StreamMasker:
        return StreamMasker(self, replace)


class StreamMasker:
    """Replaces needles in a byte stream, also one split across two chunks. It holds back only a
    chunk's end that could begin a needle, so what it passes on stays prompt and in order (the
    engine's log: two streams interleaved as they came). `counts` adds one per label found."""

    def __init__(self, scanner: Scanner, replace: Callable[[str], bytes] = marker) -> None:
        self.scanner, self.replace = scanner, replace
        self.counts: Counter[str] = Counter()
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        rx = self.scanner._rx
        if rx is None:
            return chunk
        self._buf += chunk
        buf = self._buf
        cut = len(buf) - self._held(buf)
        # A match that starts before the cut ends inside the buffer: emit it whole, replaced.
        for m in rx.finditer(buf):
            if m.start() < cut < m.end():
                cut = m.end()
        out, self._buf = buf[:cut], buf[cut:]
        return self.scanner.mask(out, self.counts, self.replace)

    def _held(self, buf: bytes) -> int:
        """The length of the buffer's longest end that could begin a match: only that waits for
        the next chunk, so what is passed on stays prompt and in order."""
        first = self.scanner.first_bytes
        for p in range(max(0, len(buf) - self.scanner.longest + 1), len(buf)):
            if buf[p] in first and self.scanner.may_begin(buf[p:]):
                return len(buf) - p
        return 0

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return self.scanner.mask(out, self.counts, self.replace)

    def wrap(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The stream `chunks`, masked."""
        for chunk in chunks:
            if out := self.feed(chunk):
                yield out
        if out := self.flush():
            yield out
