"""`fila` as a process on a host whose fake container engine has only some engines' images: a host
that lacks an engine, as a host without `fila images build ENGINE` does.

Run as `python -m tests.support.fake_host ARGS...` (the arguments are fila's) with
FILA_BACKEND=fake and FILA_FAKE_IMAGES=ENGINE[,ENGINE...]: the fake backend (sandbox/fake.py)
then holds those engines' images only, through its documented `images` argument. The rest is
fila's own CLI, unchanged.
"""

from __future__ import annotations

import os

ENV = "FILA_FAKE_IMAGES"


def main() -> None:
    import fila.sandbox
    from fila.cli import main as fila_main
    from fila.sandbox.fake import FakeBackend
    from fila.sandbox.images import image_tag

    names = [n for n in os.environ.get(ENV, "").split(",") if n]
    images = {image_tag(n): f"sha256:{n.encode().hex():0>64}" for n in names}
    fila.sandbox.BACKENDS["fake"] = lambda: FakeBackend(images=images)
    fila_main()


if __name__ == "__main__":
    main()
