"""A run's output as classification reads it (docs/architecture.md, "Layers"; docs/engines.md,
"Classifying a run").

The backends produce it and the engine adapters read it: it lives below both, so neither imports
the other.
"""

from __future__ import annotations

from dataclasses import dataclass

# How much of stderr classification keeps: the end, where a CLI's last words are.
STDERR_TAIL = 256 << 10


@dataclass(frozen=True)
class RunOutput:
    """The container's output as classification reads it, redacted like the log: stdout whole (a
    CLI's structured result, however large), up to the policy's max_log_bytes, and the last
    STDERR_TAIL bytes of stderr (its warnings and errors)."""

    stdout: bytes = b""
    stderr: bytes = b""
    # stdout may miss its end: the log reached max_log_bytes and fila stopped reading the output.
    stdout_truncated: bool = False
    # stderr's start was dropped: only its tail is kept.
    stderr_truncated: bool = False

    def text(self) -> str:
        """stderr's tail, then stdout: what the text rules (quota, auth) read."""
        return (self.stderr + b"\n" + self.stdout).decode(errors="replace")

    def out(self) -> str:
        return self.stdout.decode(errors="replace")
