"""Text fila shows that someone else chose (names in an engine-written tree, log lines, upstream
messages): written so a person sees it for what it is, never as terminal controls, bidi overrides
or blank letters (docs/security.md). In the core because every layer that shows such text needs
it: the egress record, the review, the CLI.
"""

from __future__ import annotations

import os
import unicodedata

# Letters that render as nothing (Hangul fillers, the blank braille pattern): `exec(\u3164)`
# would show as `exec( )` and hide what runs.
_BLANK_GLYPHS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def invisible(ch: str) -> bool:
    """A character a person cannot see for what it is: shown escaped, never as itself."""
    cat = unicodedata.category(ch)
    return cat in _INVISIBLE_CATEGORIES or (cat == "Zs" and ch != " ") or ch in _BLANK_GLYPHS


def inert(raw: bytes | str) -> str:
    """A line as it may be shown: tabs kept; control and format characters, lone surrogates and
    bytes that are not UTF-8 written as escapes."""
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    if text.isascii() and text.isprintable():
        return text
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\t":
            out.append(ch)
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif invisible(ch):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def escape_name(rel: str) -> str:
    """`rel` as it may be shown to a person or stored in JSON: unambiguous and inert.

    Invalid UTF-8 bytes become \\xNN, control and format characters (newline, ESC, bidi
    overrides) become \\n, \\x1b, \\u202e, and a backslash is doubled so nothing is ambiguous.
    """
    if rel.isascii() and rel.isprintable() and "\\" not in rel:
        return rel  # the common case, kept fast: this runs for every name in a tree
    out: list[str] = []
    for ch in os.fsencode(rel).decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif invisible(ch):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)
