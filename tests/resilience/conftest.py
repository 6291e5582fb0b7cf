"""The soak test runs only when asked for (`make soak`, or `-m soak`): it takes minutes."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: minutes-long load test; only with -m soak (make soak)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest rather than `addopts = -m "not soak"`: a later `-m e2e` would replace that filter.
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="soak test: run with -m soak (make soak)")
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(skip)
