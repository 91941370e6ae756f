"""The scrubber: every form of a route's key an upstream echoes is replaced by a marker of the same
length (`Needles`), in a plain stream (`StreamScrubber`) or an event stream (`SseScrubber`).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from typing import Any

from .config import MAX_SSE_LINE
from .jsonvalues import json_values, name_of, strings_list, strings_of, with_strings

# ---------------------------------------------------------------- credential scrubbing


SCRUB_MARKER = b"fila-scrubbed"
MAX_SSE_HOLD = 1024 * 1024  # bytes of complete SSE events held back for a key spread over several


HTML_ZEROS = 8  # leading zeros a character reference may have (`&#00000045;`)
# What may break a base64 text between two characters: CRLF, CR, LF or a space, as is or JSON-escaped.
_B64_BREAK = r"(?:\r\n|[\r\n ]|\\r\\n|\\[rn]|\\u0020)"


def _hex_class(n: int) -> str:
    """`%2d`, `%2D`: a byte's two hex digits, either case."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in f"{n:02x}")


class Needles:
    """Every form of the route credentials a response must not carry to the engine, as one regex:
    each character of a key literal, percent-encoded once or twice (`%2d`, `%252D`, either case),
    JSON-escaped (`\\u00xx`, `\\/`), a JS/Python escape (`\\x2d`, either case) or an HTML
    character reference (`&#45;`, `&#x2d;`, the `;` optional, up to HTML_ZEROS leading zeros), in any
    mixture; the key's hex (either case); and the key's base64 (standard and urlsafe) at each of the
    three alignments it can have inside a longer encoded text (the whole groups only: the odd bytes
    at its ends leak at most two characters), a line break (CRLF, LF or CR, as MIME wraps it) or a
    space, as is or JSON-escaped, allowed between any two of its characters. Matches are replaced by
    a marker of the same length, so a response's Content-Length stays true."""

    def __init__(self, keys: Iterable[str]) -> None:
        keys = sorted({k for k in keys if k}, key=len, reverse=True)
        self.b64: set[bytes] = set()
        self.hex: set[bytes] = set()
        alts: list[str] = []
        longest = 0
        for key in keys:
            parts = []
            for ch in key:
                n = ord(ch)
                forms = [re.escape(ch)]
                if n < 0x80:
                    forms += [
                        f"%(?:25)?{_hex_class(n)}",
                        f"\\\\u00{_hex_class(n)}",
                        f"\\\\x{_hex_class(n)}",
                        f"&#0{{0,{HTML_ZEROS}}}{n};?",
                        f"&#[xX]0{{0,{HTML_ZEROS}}}{_hex_class(n)};?",
                    ]
                    if ch in '/"\\':
                        forms.append(re.escape("\\" + ch))
                parts.append("(?:" + "|".join(forms) + ")")
            alts.append("".join(parts))
            raw = key.encode()
            longest = max(
                longest, (6 + HTML_ZEROS) * len(raw)
            )  # `&#x0..0hh;`: the longest form of one character
            self.hex.add(raw.hex().encode())
            alts.append("".join(_hex_class(b) for b in raw))
            for a in range(3):
                whole = raw[a:][: (len(raw) - a) // 3 * 3]
                if len(whole) >= 6:  # shorter would match ordinary text
                    for enc in (base64.b64encode(whole), base64.urlsafe_b64encode(whole)):
                        self.b64.add(enc)
                        longest = max(longest, 7 * len(enc))  # a break (6 escaped) after each character
        # A line break or a space (as is or JSON-escaped) may come between any two characters.
        brk = _B64_BREAK + "?"
        alts += [brk.join(re.escape(c) for c in b.decode()) for b in sorted(self.b64, key=len, reverse=True)]
        self.empty = not alts
        pattern = "|".join(alts) or "(?!)"
        self.rx = re.compile(pattern.encode())
        self.rx_text = re.compile(pattern)
        self.longest = longest
        self.starts = list(keys) + [b.decode() for b in self.b64]

    def starts_in(self, text: str, least: int) -> bool:
        """Whether `text` ends with the first `least` or more characters of a key or of one of
        its base64 forms (the rest of it may come next)."""
        for n in self.starts:
            for k in range(min(len(text), len(n) - 1), least - 1, -1):
                if text.endswith(n[:k]):
                    return True
        return False

    def kind(self, match: bytes | str) -> str:
        raw = match.encode() if isinstance(match, str) else match
        if re.sub(_B64_BREAK.encode(), b"", raw) in self.b64:
            return ":base64"
        if raw.lower() in self.hex:
            return ":hex"
        if b"\\" in raw:
            return ":json"
        if b"%" in raw:
            return ":url"
        if b"&#" in raw:
            return ":html"
        return ""

    def scrub(self, data: bytes, where: str, counts: dict[str, int]) -> bytes:
        """`data` with every match replaced, each counted in `counts` as where[:encoding]."""
        if self.empty or not data:
            return data

        def rep(m: re.Match[bytes]) -> bytes:
            kind = where + self.kind(m[0])
            counts[kind] = counts.get(kind, 0) + 1
            return _marker(len(m[0]))

        return self.rx.sub(rep, data)

    def scrub_text(self, text: str, where: str, counts: dict[str, int]) -> str:
        raw = text.encode("utf-8", "surrogateescape")
        out = self.scrub(raw, where, counts)
        return text if out is raw or out == raw else out.decode("utf-8", "surrogateescape")


def _marker(n: int) -> bytes:
    return (SCRUB_MARKER + b"*" * n)[:n] if n >= len(SCRUB_MARKER) else b"*" * n


class StreamScrubber:
    """A response body's bytes on their way to the engine, any content type: matches are replaced
    as the bytes pass; the last len(longest form) - 1 bytes are held back until the next chunk (a
    key split across chunks), and flushed at the end."""

    def __init__(self, needles: Needles, counts: dict[str, int]) -> None:
        self.needles = needles
        self.counts = counts
        self.hold = b""

    def __call__(self, chunk: bytes) -> bytes:
        buf = self.hold + chunk
        if not chunk:  # the end: nothing more can complete a match
            self.hold = b""
            return self.needles.scrub(buf, "body", self.counts)
        cut = max(0, len(buf) - (self.needles.longest - 1))
        for m in self.needles.rx.finditer(buf):
            if m.end() > cut:
                if m.start() < cut:
                    cut = m.end()  # a whole match across the cut: out with it, replaced
                break
        self.hold = buf[cut:]
        return self.needles.scrub(buf[:cut], "body", self.counts)


# The blank line that ends an event: two line ends in a row, each CRLF, LF or CR (a CRLF is one
# line end, never a CR and then an LF: the groups are atomic).
_SSE_END = re.compile(rb"(?>\r\n|\n|\r)(?>\r\n|\n|\r)")


class SseScrubber:
    """A route's answer, passed on event by event (never the whole body): any content type goes
    through it (an engine may read a stream whatever its Content-Type says), and a body that is no
    event stream is one event, scrubbed as bytes. Each complete event is scrubbed as bytes. An
    engine also joins strings of successive events (text deltas, tool argument pieces, a content
    block's start and its deltas, a candidate's parts): per field (its JSON path), per field name,
    and over all strings in order, the text so far is searched too, so a key spread over several
    strings is found, and its characters in events not yet sent are replaced. An event whose field ends with
    SPLIT_MIN or more characters of the start of a form of a key is held back until the next events
    show whether the key goes on (at the end of the stream it is sent): what may reach the engine
    before the rest of a split key is found is fewer than SPLIT_MIN of its first characters. An
    event still incomplete past MAX_SSE_LINE goes through the byte filter as it arrives, up to its
    end, and the events after it are read as events again; held events past MAX_SSE_HOLD bytes are
    sent (a key's first characters then reach the engine, never the rest of it)."""

    SPLIT_MIN = 8

    def __init__(self, needles: Needles, counts: dict[str, int]) -> None:
        self.needles = needles
        self.counts = counts
        self.raw = b""
        self.held: list[_SseEvent] = []
        self.sent: dict[tuple[Any, ...], str] = {}  # per running text: the end of what was passed on
        self.oversized: StreamScrubber | None = None  # the byte filter of an event past MAX_SSE_LINE
        self._tail = b""  # the last bytes of the oversized event so far

    def __call__(self, chunk: bytes) -> bytes:
        final = not chunk
        out = b""
        if self.oversized is not None:
            out += self._pass_oversized(chunk)
            if self.oversized is not None or final:
                return out
            chunk, self.raw = self.raw, b""  # what came after the oversized event's end
        self.raw += chunk
        ends = list(_SSE_END.finditer(self.raw))
        cut = len(self.raw) if final else (ends[-1].end() if ends else 0)
        block, self.raw = self.raw[:cut], self.raw[cut:]
        start = 0
        for m in _SSE_END.finditer(block):
            self.held.append(_SseEvent(self.needles.scrub(block[start : m.end()], "body", self.counts)))
            start = m.end()
        if start < len(block):
            self.held.append(_SseEvent(self.needles.scrub(block[start:], "body", self.counts)))
        wait = self._scan() and not final and sum(len(e.raw) for e in self.held) <= MAX_SSE_HOLD
        out += self._emit(not wait)
        if len(self.raw) > MAX_SSE_LINE:
            out += self._emit(True)
            self.oversized = StreamScrubber(self.needles, self.counts)
            self._tail = b""
            data, self.raw = self.raw, b""
            out += self._pass_oversized(data)
            if self.oversized is None and self.raw:
                rest, self.raw = self.raw, b""
                out += self(rest)
        return out

    def _pass_oversized(self, chunk: bytes) -> bytes:
        """The bytes of an oversized event through the byte filter up to its end (the end of the
        stream, or its blank line: what follows is left in self.raw, to be read as events)."""
        assert self.oversized is not None
        if not chunk:
            out = self.oversized(b"")
            self.oversized = None
            return out
        tail = self._tail  # a blank line split across chunks: the bytes just before count too
        self._tail = (tail + chunk)[-3:]
        end = next((m.end() for m in _SSE_END.finditer(tail + chunk) if m.end() > len(tail)), None)
        if end is None:
            return self.oversized(chunk)
        at = end - len(tail)
        out = self.oversized(chunk[:at]) + self.oversized(b"")
        self.oversized = None
        self.raw = chunk[at:]
        return out

    def _scan(self) -> bool:
        """Replace the keys found in the running texts across events; True when the held events
        must wait. Three kinds of running text, searched in turn (what one finds is gone from the
        next): each field by its JSON path, each field name wherever it is (`content_block.text`
        then `delta.text`, `parts[0].text` then `parts[1].text`), and all string values in order."""
        if self.needles.empty or not self.held:
            return False
        wait = False
        for group in (lambda p: ("path", p), name_of, lambda p: ("all",)):
            fields: dict[Any, list[tuple[int, _SseEvent, int]]] = {}
            texts: dict[Any, list[str]] = {}
            for ev in self.held:
                for i, (path, s) in enumerate(ev.strings):
                    key = group(path)
                    parts = texts.setdefault(key, [self.sent.get(key, "")])
                    fields.setdefault(key, []).append((sum(map(len, parts)), ev, i))
                    parts.append(s)
            for key, parts in texts.items():
                text = "".join(parts)
                for m in self.needles.rx_text.finditer(text):
                    kind = "body:split" + self.needles.kind(m[0])
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                    for off, ev, i in fields[key]:
                        p, piece = ev.strings[i]
                        lo, hi = max(m.start(), off), min(m.end(), off + len(piece))
                        if lo < hi:
                            ev.strings[i] = (p, piece[: lo - off] + "*" * (hi - lo) + piece[hi - off :])
                            ev.changed = True
                    text = text[: m.start()] + "*" * len(m[0]) + text[m.end() :]
                wait = wait or self.needles.starts_in(text[-self.needles.longest :], self.SPLIT_MIN)
        return wait

    def _emit(self, go: bool) -> bytes:
        if not go:
            return b""
        out = []
        for ev in self.held:
            for path, s in ev.strings:
                for key in (("path", path), name_of(path), ("all",)):
                    self.sent[key] = (self.sent.get(key, "") + s)[-self.needles.longest :]
            out.append(ev.bytes())
        self.held = []
        return b"".join(out)


class _SseEvent:
    """One event's bytes and the string values of its data (JSON), each with its path. A body that
    is no event stream (no `data:` line) is read as JSON values one after another: a whole JSON
    document, JSON lines (NDJSON), or the elements of a JSON array (Gemini's streamGenerateContent
    without alt=sse), so that its strings join the same running texts."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.changed = False
        self.obj: Any = None
        self.json = False
        self.strings: list[tuple[tuple[Any, ...], str]] = []
        self.values: list[tuple[int, int, Any, int]] | None = None  # (start, end, value, strings)
        data = [ln[5:].removeprefix(b" ") for ln in re.split(rb"\r\n|\n|\r", raw) if ln.startswith(b"data:")]
        if not data:
            self.values = []
            for start, end, value in json_values(raw.decode("utf-8", "surrogateescape")):
                n = len(self.strings)
                strings_of(value, (), self.strings)
                self.values.append((start, end, value, len(self.strings) - n))
            return
        text = b"\n".join(data).decode("utf-8", "surrogateescape")
        try:
            self.obj = json.loads(text)
            self.json = True
        except ValueError:
            self.obj = text
        strings_of(self.obj, (), self.strings)

    def bytes(self) -> bytes:
        """The event with its replaced strings, exactly as long as it came (a declared
        Content-Length stays true): padded with spaces after the data, or, should the data come
        out longer, an empty string as the data."""
        if not self.changed:
            return self.raw
        if self.values is not None:
            return self._rebuild_values()
        obj = with_strings(self.obj, iter(s for _, s in self.strings))
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")) if self.json else obj
        out = self._build(data, 0)
        if len(out) > len(self.raw):
            data = '""' if self.json else ""
            out = self._build(data, 0)
        return self._build(data, max(0, len(self.raw) - len(out)))

    def _rebuild_values(self) -> bytes:
        """The body with each JSON value that holds a replaced string written anew, padded with
        spaces to its length (or an empty string, padded, should it come out longer)."""
        assert self.values is not None
        text = self.raw.decode("utf-8", "surrogateescape")
        out, at, first = [], 0, 0
        for start, end, value, n in self.values:
            mine = [s for _, s in self.strings[first : first + n]]
            first += n
            if mine == [s for _, s in strings_list(value)]:
                continue
            new = json.dumps(with_strings(value, iter(mine)), ensure_ascii=False, separators=(",", ":"))
            size = len(text[start:end].encode("utf-8", "surrogateescape"))
            if len(new.encode("utf-8", "surrogateescape")) > size:
                new = '""'
            new += " " * (size - len(new.encode("utf-8", "surrogateescape")))
            out += [text[at:start], new]
            at = end
        out.append(text[at:])
        return "".join(out).encode("utf-8", "surrogateescape")

    def _build(self, data: str, pad: int) -> bytes:
        out, placed = [], False
        for ln in re.split(rb"\r\n|\n|\r", self.raw):
            if ln.startswith(b"data:"):
                if not placed:
                    out += [b"data: " + x.encode("utf-8", "surrogateescape") for x in data.split("\n")]
                    out[-1] += b" " * pad
                    placed = True
            else:
                out.append(ln)
        return b"\n".join(out)
