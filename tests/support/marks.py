"""Marks on parametrized cases."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def quick_for(values: Iterable[Any], *quick: Any) -> list[Any]:
    """Parametrize values with the `quick` mark on the chosen ones: the quick tier
    (`scripts/test --quick`) runs those cases of a test that runs every value in the full suite."""
    chosen = set(quick)
    missing = chosen - set(values)
    assert not missing, f"quick_for: {sorted(missing)} are not among the values"
    return [pytest.param(v, marks=pytest.mark.quick) if v in chosen else v for v in values]


def matrix_beyond(values: Iterable[Any], *default: Any) -> list[Any]:
    """Parametrize an engine CLI's failure case so the full suite runs it for the chosen values
    and `scripts/test --all` for every value: the values left out carry the `matrix` mark. What the
    left-out runs add is today's CLI meeting a case whose handling is fila's (the timeout, the
    error class of a cut stream, the log cap) or whose classification every run proves on the
    CLI's captured output (tests/fixtures/engines/<engine>/quota.log); it changes with the image.
    A tuple value is a row of several parameters."""
    chosen = set(default)
    missing = chosen - set(values)
    assert not missing, f"matrix_beyond: {sorted(missing)} are not among the values"
    left_out = lambda v: pytest.param(*v if isinstance(v, tuple) else (v,), marks=pytest.mark.matrix)  # noqa: E731
    return [v if v in chosen else left_out(v) for v in values]
