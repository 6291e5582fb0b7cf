"""Every test here runs the Triton kernels under the interpreter on CPU (interp.py says why the
variable is set per test, not for the session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.scheduler.attention.interp import interpreted


@pytest.fixture(autouse=True)
def _triton_interpreter() -> Iterator[None]:
    with interpreted():
        yield
