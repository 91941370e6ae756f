"""What the tests share, by role. Fixtures live in tests/conftest.py; the plain helpers here.

- project: a queue root, a project in it, a task, a record, the fake backend
- cli: the CLI in-process and as a process, submitting a shell task
- policy: policy documents (in memory and written under policies/)
- containers: what the daemon holds for a root (containers, volumes, starts)
- crash: where each crash point leaves a task, and the one-state-each check
- engines: the end-to-end engine specs against the scripted model server
- trees: file trees for the diff and snapshot properties
- spy: the reads and processes a block made, and a call that must not block
- users: fila and pytest as a throwaway ordinary user (Docker and rootless Podman)
- marks: the quick tier's parametrize helper

A test module imports from here and from tests.upstreams, never from another test module
(tests/test_suite_rules.py).
"""
