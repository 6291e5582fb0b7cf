"""Building the C kernels' library: cached, and none without a compiler."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.kernels import kernel_build


def test_no_compiler_means_no_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert kernel_build.build(cache=str(tmp_path)) is None
    assert list(tmp_path.rglob("*.so")) == []


def test_build_is_cached(tmp_path: Path) -> None:
    first = kernel_build.build(cache=str(tmp_path))
    if first is None:
        pytest.skip("no C compiler on this machine")
    assert first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build(cache=str(tmp_path)) == first and first.stat().st_mtime_ns == mtime
