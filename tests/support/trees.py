"""File trees for the diff and snapshot properties: a tree is {relative path: Node}, built on disk
by `build`; `tree_pairs` draws a (before, after) pair an engine's edit could leave."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import strategies as st

from fila.workspace.diff import _means

Node = tuple  # ("file", bytes, exec: bool) | ("link", target)


def put(root: Path, rel: str | bytes, data: bytes = b"", *, mode: int = 0o644,
        link: str | bytes | None = None) -> None:  # fmt: skip
    path = os.fsencode(root) + b"/" + (rel if isinstance(rel, bytes) else os.fsencode(rel))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if link is not None:
        os.symlink(link, path)
        return
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def build(root: Path, tree: dict[str, Node]) -> None:
    for rel, node in tree.items():
        if node[0] == "link":
            put(root, rel, link=node[1])
        else:
            put(root, rel, node[1], mode=0o755 if node[2] else 0o644)


DIRS = ["", "d", "sub dir", "ü", "d/ü"]
ODD = ["a", "b c", "é.txt", "日本", "new\nline", "esc\x1b[0m", "-dash", 'q"uote', "back\\slash",
       "tab\there", os.fsdecode(b"bad\xff\xfe"), ".gitattributes"]  # fmt: skip


def _plain_name(name: str) -> bool:
    return (name not in {".", ".."} and name not in DIRS and len(os.fsencode(name)) < 200
            and not _means(name, "git", "git~1") and not _means(name, "gitmodules", "gitmod~1"))  # fmt: skip


names = st.one_of(
    st.sampled_from(ODD),
    st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=8).filter(
        _plain_name
    ),
)
paths = st.tuples(st.sampled_from(DIRS), names).map(lambda t: f"{t[0]}/{t[1]}" if t[0] else t[1])
lines = st.lists(st.sampled_from([b"alpha", b"beta", b"gamma delta", b"", b"\tx", b"crlf\r"]),
                 max_size=30)  # fmt: skip
text = st.tuples(lines, st.booleans()).map(lambda t: b"\n".join(t[0]) + (b"\n" if t[1] else b""))
content = st.one_of(st.just(b""), text, st.binary(max_size=300), st.binary(max_size=50).map(
    lambda b: b"\0" + b))  # fmt: skip
file_node = st.tuples(st.just("file"), content, st.booleans())
link_node = st.tuples(st.just("link"), st.sampled_from(
    ["a", "../x", "/etc/passwd", "d/ü", "nowhere", "sp ace", "é", "new\nline"]))  # fmt: skip
nodes = st.one_of(file_node, file_node, link_node)
trees = st.dictionaries(paths, nodes, max_size=8)


@st.composite
def tree_pairs(draw: st.DrawFn) -> tuple[dict[str, Node], dict[str, Node]]:
    before = draw(trees)
    after: dict[str, Node] = {}
    for rel, node in before.items():
        op = draw(st.sampled_from(["keep", "keep", "change", "delete", "chmod", "append"]))
        if op == "keep" or (op in {"chmod", "append"} and node[0] != "file"):
            after[rel] = node
        elif op == "change":
            after[rel] = draw(nodes)
        elif op == "chmod":
            after[rel] = ("file", node[1], not node[2])
        elif op == "append":
            after[rel] = ("file", node[1] + draw(text), node[2])
    after.update(draw(trees))
    return before, after
