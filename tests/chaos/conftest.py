"""The long chaos run only when asked for (`make chaos`, or `-m chaos`); the short one is always on."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest rather than `addopts = -m "not chaos"`: a later `-m e2e` would replace that filter.
    if "chaos" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long chaos run: make chaos (or -m chaos)")
    for item in items:
        if item.get_closest_marker("chaos"):
            item.add_marker(skip)
