"""fswalk: walking and reading a tree an untrusted party wrote."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fila.core.errors import FilaError, LimitExceeded
from fila.workspace.fswalk import Tree, escape_name, read_file, walk
from tests.support.spy import finishes, watch

BIG = 1 << 40


def entries(root: Path, **kw: object) -> list[tuple[str, str]]:
    limits: dict = {"max_files": 1000, "max_bytes": BIG, **kw}
    return [(e.rel, e.kind) for e in walk(root, **limits)]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "b" / "c").mkdir(parents=True)
    (root / "a-b").write_text("x")
    (root / "b" / "c" / "f").write_text("f")
    (root / "b" / "e").write_text("e")
    (root / "z").write_text("zz")
    (root / "link").symlink_to("b")  # a symlink to a directory: never descended
    os.mkfifo(root / "fifo")
    return root


def test_walk_is_sorted_depth_first_and_never_follows_links(tree: Path) -> None:
    assert entries(tree) == [
        ("a-b", "file"),
        ("b", "dir"),
        ("b/c", "dir"),
        ("b/c/f", "file"),
        ("b/e", "file"),
        ("fifo", "other"),
        ("link", "symlink"),
        ("z", "file"),
    ]


def test_an_entry_has_the_size_mode_and_link_count_of_its_lstat(tree: Path) -> None:
    os.link(tree / "z", tree / "hard")
    by = {e.rel: e for e in walk(tree, max_files=100, max_bytes=BIG)}
    assert by["z"].size == 2 and stat.S_ISREG(by["z"].mode) and by["z"].nlink == 2
    assert stat.S_ISLNK(by["link"].mode)


def test_skip_prunes_and_is_told_directories(tree: Path) -> None:
    seen: list[tuple[str, bool]] = []

    def skip(rel: str, is_dir: bool) -> bool:
        seen.append((rel, is_dir))
        return rel == "b" or rel == "z"

    assert entries(tree, skip=skip) == [("a-b", "file"), ("fifo", "other"), ("link", "symlink")]
    assert ("b", True) in seen and ("z", False) in seen and ("link", False) in seen
    assert not any(rel.startswith("b/") for rel, _ in seen)


def test_skipped_entries_count_toward_no_limit(tree: Path) -> None:
    assert len(entries(tree, max_files=8, skip=lambda rel, d: rel != "z")) == 1


def test_refuses_a_root_that_is_a_symlink_or_not_a_directory(tmp_path: Path, tree: Path) -> None:
    (tmp_path / "ln").symlink_to(tree)
    with pytest.raises(FilaError, match="symlink"):
        entries(tmp_path / "ln")
    with pytest.raises(FilaError, match="not a directory"):
        entries(tree / "z")
    with pytest.raises(FilaError, match="not found"):
        entries(tmp_path / "missing")


def test_limit_on_entries(tree: Path) -> None:
    with pytest.raises(LimitExceeded, match="max_files=3"):
        entries(tree, max_files=3)


def test_limit_on_one_huge_directory_before_listing_it_all(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / str(i)).write_text("")
    with pytest.raises(LimitExceeded, match="max_files=10 entries in one directory"):
        entries(tmp_path, max_files=10)


def test_limit_on_bytes_uses_the_size_of_a_sparse_file_without_reading_it(tmp_path: Path) -> None:
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 40)  # 1 TB, no blocks
    with watch() as seen, pytest.raises(LimitExceeded, match="max_bytes=1073741824"):
        entries(tmp_path, max_bytes=1 << 30)
    assert not seen.read(tmp_path / "sparse")


def test_limit_on_depth_and_path_length(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    assert len(entries(tmp_path, max_depth=3)) == 3
    with pytest.raises(LimitExceeded, match="max_depth=2"):
        entries(tmp_path, max_depth=2)
    (tmp_path / ("n" * 100)).write_text("")
    with pytest.raises(LimitExceeded, match="max_path_bytes=50"):
        entries(tmp_path, max_path_bytes=50)


def test_a_tree_deeper_than_path_max_is_walked_and_read_through_fds(tmp_path: Path) -> None:
    root = tmp_path / "deep"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    name = "d" * 200
    for _ in range(30):  # 30 * 201 bytes: far beyond PATH_MAX (4096) from the root
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    wfd = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(wfd, b"deep")
    os.close(wfd)
    os.close(fd)
    found = list(walk(root, max_files=100, max_bytes=BIG, max_path_bytes=1 << 16))
    leaf = found[-1]
    assert leaf.kind == "file" and leaf.rel.endswith("/leaf") and len(leaf.rel) > 6000
    with Tree(root) as t:
        fd, size = t.open(leaf.rel, max_bytes=10)
        try:
            assert os.read(fd, 10) == b"deep" and size == 4
        finally:
            os.close(fd)


def test_names_that_are_not_utf8_walk_and_read(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path) + b"/bad\xff\nname"
    with open(raw, "wb") as f:
        f.write(b"data")
    [e] = walk(tmp_path, max_files=10, max_bytes=BIG)
    assert os.fsencode(e.rel) == b"bad\xff\nname"
    assert read_file(tmp_path / e.rel, max_bytes=10) == b"data"
    assert escape_name(e.rel) == "bad\\xff\\nname"


def test_read_file_returns_a_regular_file_within_its_limit_and_refuses_the_rest(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"12345")
    assert read_file(tmp_path / "f", max_bytes=5) == b"12345"
    with pytest.raises(LimitExceeded, match="5 bytes is over the limit of 4"):
        read_file(tmp_path / "f", max_bytes=4)
    (tmp_path / "ln").symlink_to(tmp_path / "f")
    with pytest.raises(FilaError, match="symlink"):
        read_file(tmp_path / "ln", max_bytes=5)
    with pytest.raises(FilaError, match="not a regular file"):
        read_file(tmp_path, max_bytes=5)
    (tmp_path / "empty").write_bytes(b"")
    assert read_file(tmp_path / "empty", max_bytes=0) == b""


def test_read_file_never_blocks_on_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FilaError, match="not a regular file"):
        finishes(lambda: read_file(tmp_path / "fifo", max_bytes=5))


def test_read_file_refuses_a_sparse_huge_file_before_reading(tmp_path: Path) -> None:
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 40)
    (tmp_path / "small").write_bytes(b"12345")
    with watch() as seen:
        assert read_file(tmp_path / "small", max_bytes=5) == b"12345"  # the allowed counterpart
        with pytest.raises(LimitExceeded, match="1099511627776 bytes"):
            read_file(tmp_path / "sparse", max_bytes=1 << 20)
    assert seen.read(tmp_path / "small") and not seen.read(tmp_path / "sparse")


def test_tree_never_goes_through_a_symlinked_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "dir").symlink_to(outside)
    (root / "ln").symlink_to("/etc/passwd")
    os.mkfifo(root / "fifo")
    with Tree(root) as t:
        with pytest.raises(FilaError, match="symlink"):
            t.open("dir/secret", max_bytes=10)
        with pytest.raises(FilaError, match="symlink"):
            t.open("ln", max_bytes=1 << 20)
        with pytest.raises(FilaError, match="not a regular file"):
            finishes(lambda: t.open("fifo", max_bytes=10))
        assert t.readlink("ln") == b"/etc/passwd"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("plain/name.py", "plain/name.py"),
        ("é 日本", "é 日本"),
        ("new\nline", "new\\nline"),
        ("esc\x1b[31m", "esc\\x1b[31m"),
        ("back\\slash", "back\\\\slash"),
        ("rtl\u202eexe.txt", "rtl\\u202eexe.txt"),
        (os.fsdecode(b"bad\xff"), "bad\\xff"),
        ("tab\tdel\x7f", "tab\\tdel\\x7f"),
    ],
)
def test_escape_name_shows_every_name_as_printable_text(name: str, shown: str) -> None:
    assert escape_name(name) == shown
    assert escape_name(name).isprintable()
