"""Make a prefix self-contained: every ELF file under it loads its shared libraries from the
prefix only, never from the image it runs on (docs/environments.md, "Engines on an environment").

    python3 selfcontain.py PREFIX LIBDIR

Each shared library an ELF file under PREFIX needs that lives outside PREFIX (ldd: the dynamic
loader, libc, libz, libssl, ...) is copied into LIBDIR under its soname. Every ELF file then gets a
DT_RPATH of its own entries plus $ORIGIN-relative LIBDIR (DT_RPATH, not DT_RUNPATH: it is searched
before LD_LIBRARY_PATH, so an environment's LD_LIBRARY_PATH cannot swap a library under the
prefix's Python), and every executable LIBDIR's loader as its interpreter. Nothing is set in the
environment: what the prefix's programs run (a linter, a project's command) inherits no
LD_LIBRARY_PATH. Last, each ELF file is listed by the prefix's own loader and the build fails if
any library resolves outside PREFIX or not at all.

Run at image build time by images/aider/Dockerfile; needs ldd and patchelf.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

LOADER = "ld-linux-x86-64.so.2"
# The loader and libc are used as they are: patchelf must not rewrite the loader, and libc
# needs nothing but the loader, which is already mapped when libc loads.
UNPATCHED = {LOADER, "libc.so.6"}


def elf_files(prefix: Path) -> list[Path]:
    found = []
    for dirpath, _dirs, names in os.walk(prefix):
        for name in names:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            with path.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.append(path)
    return sorted(found)


def ldd(path: Path, loader: str = "ldd") -> list[tuple[str, str | None]]:
    """(name, resolved path or None) of each library `path` loads, as `loader` resolves them."""
    # What ldd does with the system's loader, done with `loader`: a library not found is a
    # `=> not found` line, not an error.
    env = None if loader == "ldd" else {"LD_TRACE_LOADED_OBJECTS": "1"}
    res = subprocess.run([loader, str(path)], capture_output=True, text=True, env=env)
    out = res.stdout + res.stderr
    if "not a dynamic executable" in out or "statically linked" in out:
        return []
    if res.returncode != 0 and "=>" not in out:
        sys.exit(f"selfcontain: {loader} {path} failed: {out.strip()}")
    deps = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            name, _, rest = line.partition("=>")
            target = rest.split("(")[0].strip()
            deps.append((name.strip(), None if target in ("", "not found") else target))
        elif line.startswith("/"):  # the loader itself: `/lib64/ld-linux-x86-64.so.2 (0x...)`
            target = line.split("(")[0].strip()
            deps.append((Path(target).name, target))
        # linux-vdso.so.1 (the kernel's) has neither
    return deps


def patchelf(*args: str | Path) -> str:
    res = subprocess.run(["patchelf", *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"selfcontain: patchelf {' '.join(map(str, args))} failed: {res.stderr.strip()}")
    return res.stdout.strip()


def is_executable(path: Path) -> bool:
    res = subprocess.run(["patchelf", "--print-interpreter", str(path)], capture_output=True, text=True)
    return res.returncode == 0 and bool(res.stdout.strip())


def main(prefix: Path, libdir: Path) -> None:
    libdir.mkdir(parents=True, exist_ok=True)
    elves = elf_files(prefix)
    # A wheel's bundled library may need a sibling it does not find alone (numpy.libs' libgfortran
    # needs libquadmath): the extension module that loads both loads the sibling first, and the
    # loader reuses a loaded library by its soname.
    bundled = {elf.name for elf in elves}
    for elf in elves:
        for name, target in ldd(elf):
            if target is None:
                if name in bundled:
                    continue
                sys.exit(f"selfcontain: {elf} needs {name}, which is not found")
            if Path(target).resolve().is_relative_to(prefix):
                continue  # a wheel's own bundled library (auditwheel's $ORIGIN/../x.libs)
            dest = libdir / name
            if not dest.exists():
                shutil.copy2(Path(target).resolve(), dest)
    elves = elf_files(prefix)  # with the copies
    loader = libdir / LOADER
    for elf in elves:
        if elf.parent == libdir and elf.name in UNPATCHED:
            continue
        rel = os.path.relpath(libdir, elf.parent)
        mine = "$ORIGIN" if rel == "." else f"$ORIGIN/{rel}"
        have = [p for p in patchelf("--print-rpath", elf).split(":") if p]
        patchelf("--force-rpath", "--set-rpath", ":".join(dict.fromkeys([*have, mine])), elf)
        if is_executable(elf):
            patchelf("--set-interpreter", loader, elf)
    outside = []
    for elf in elves:
        if elf == loader:
            continue
        for name, target in ldd(elf, str(loader)):
            if target is None and name in bundled:
                continue
            if target is None or not Path(target).resolve().is_relative_to(prefix):
                outside.append(f"{elf}: {name} => {target}")
    if outside:
        sys.exit("selfcontain: libraries outside the prefix:\n" + "\n".join(outside))
    print(f"selfcontain: {len(elves)} ELF files under {prefix}, libraries in {libdir}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
