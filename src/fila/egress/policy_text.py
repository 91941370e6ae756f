"""The locked policy as an edit of the policy file's own text (README, "Learn, then lock").

`fila policy suggest` proposes a diff the operator reads and applies: it must show what changes (the
allowlist, `learn` gone) and nothing else, whatever the file's layout (the shipped policies keep a
`deny` array on one line). So the proposal is the old text with only the spans of `egress.allow` and
`egress.learn` rewritten, in the indentation the file already uses; the file's other bytes, its
final newline or its lack of one included, stay as they were. A text this edit cannot place (an
`egress` that is not an object, a repeated key) or whose result does not parse to the proposed
document falls back to the whole document re-serialised: a larger diff, never a wrong one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_INDENT = re.compile(r"[ \t]*")


@dataclass(frozen=True)
class _Member:
    key: str
    key_start: int
    value_start: int
    value_end: int


@dataclass(frozen=True)
class _Object:
    members: list[_Member]
    start: int  # the `{`
    close: int  # the `}`

    def get(self, key: str) -> _Member | None:
        found = [m for m in self.members if m.key == key]
        return found[0] if found else None


def _skip(text: str, i: int) -> int:
    m = _WS.match(text, i)
    return m.end() if m else i


def _object(text: str, start: int) -> _Object | None:
    """The members of the JSON object whose `{` is at `start`, each with its spans; None for
    anything else or for an object that repeats a key."""
    if text[start : start + 1] != "{":
        return None
    members: list[_Member] = []
    i = _skip(text, start + 1)
    if text[i : i + 1] == "}":
        return _Object(members, start, i)
    while True:
        if text[i : i + 1] != '"':
            return None
        key, j = _DECODER.raw_decode(text, i)
        j = _skip(text, j)
        if text[j : j + 1] != ":":
            return None
        v = _skip(text, j + 1)
        _, end = _DECODER.raw_decode(text, v)
        members.append(_Member(key, i, v, end))
        i = _skip(text, end)
        if text[i : i + 1] == "}":
            break
        if text[i : i + 1] != ",":
            return None
        i = _skip(text, i + 1)
    if len({m.key for m in members}) != len(members):
        return None
    return _Object(members, start, i)


def _indent_at(text: str, i: int) -> str:
    line = text.rfind("\n", 0, i) + 1
    m = _INDENT.match(text, line)
    return m.group() if m else ""


def _unit(text: str, top: _Object) -> str:
    """The file's indentation step: the first member's indentation past its object's line."""
    first = top.members[0].key_start if top.members else top.close
    inner, outer = _indent_at(text, first), _indent_at(text, top.start)
    step = inner[len(outer) :] if inner.startswith(outer) else inner
    return step or "  "


def _value(value: Any, text: str, obj: _Object, at: int, unit: str) -> str:
    """`value` as the member at `at` of `obj` is written: indented below it when `obj` spans
    lines, on one line when `obj` does."""
    if "\n" not in text[obj.start : obj.close]:
        return json.dumps(value)
    return json.dumps(value, indent=unit).replace("\n", "\n" + _indent_at(text, at))


def _member_after(text: str, obj: _Object, key: str, value: Any, unit: str) -> tuple[int, int, str]:
    """The edit that adds `"key": value` as `obj`'s last member, separated as its members are."""
    ms = obj.members
    if not ms:
        return obj.close, obj.close, f"{json.dumps(key)}: {json.dumps(value)}"
    if len(ms) >= 2:
        sep = text[ms[-2].value_end : ms[-1].key_start]
    elif "\n" in text[obj.start : ms[0].key_start]:
        sep = ",\n" + _indent_at(text, ms[0].key_start)
    else:
        sep = ", "
    return (
        ms[-1].value_end,
        ms[-1].value_end,
        f"{sep}{json.dumps(key)}: {_value(value, text, obj, ms[-1].key_start, unit)}",
    )


def _edits(text: str, allow: list[dict[str, Any]], section: str) -> list[tuple[int, int, str]] | None:
    top = _object(text, _skip(text, 0))
    if top is None:
        return None
    unit = _unit(text, top)
    eg_member = top.get(section)
    if eg_member is None:
        return [_member_after(text, top, section, {"allow": allow}, unit)]
    eg = _object(text, eg_member.value_start)
    if eg is None:
        return None
    old_allow, learn = eg.get("allow"), eg.get("learn")
    edits: list[tuple[int, int, str]] = []
    if old_allow is not None:
        edits.append(
            (old_allow.value_start, old_allow.value_end, _value(allow, text, eg, old_allow.key_start, unit))
        )
    elif learn is not None:  # the new allowlist takes learn's place
        new = f'"allow": {_value(allow, text, eg, learn.key_start, unit)}'
        return [(learn.key_start, learn.value_end, new)]
    else:
        edits.append(_member_after(text, eg, "allow", allow, unit))
    if learn is not None:
        k = eg.members.index(learn)
        if k > 0:  # from the end of the member before it: its comma and line go with it
            edits.append((eg.members[k - 1].value_end, learn.value_end, ""))
        else:  # the first: up to the next member's key
            edits.append((learn.key_start, eg.members[1].key_start, ""))
    return edits


def locked_text(
    old_text: str, new_doc: dict[str, Any], allow: list[dict[str, Any]], section: str = "egress"
) -> str:
    """`old_text` (a policy file) with `allow` as its `section`'s allowlist (`egress`, or
    `environment` for a project environment's setup) and `learn` removed, every other byte kept;
    `new_doc` re-serialised when the edit cannot be placed or would not give `new_doc`."""
    whole = json.dumps(new_doc, indent=2) + "\n"
    try:
        edits = _edits(old_text, allow, section)
    except ValueError:  # json's decoder on text it cannot read
        return whole
    if edits is None:
        return whole
    out = old_text
    for start, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
        out = out[:start] + new + out[end:]
    try:
        same = json.loads(out) == new_doc
    except ValueError:
        same = False
    return out if same else whole
