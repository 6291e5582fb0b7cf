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
    """A small source of its own: the kernels' own take most of a minute to compile, once per machine
    (every other test loads them from the default cache)."""
    src = tmp_path / "src" / "one.c"
    src.parent.mkdir()
    src.write_text("int one(void) { return 1; }\n")
    cache = tmp_path / "cache"
    first = kernel_build.build((src,), cache=str(cache))
    if first is None:
        pytest.skip("no C compiler on this machine")
    assert first.parent == cache
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build((src,), cache=str(cache)) == first and first.stat().st_mtime_ns == mtime
    src.write_text("int one(void) { return 2; }\n")  # another source: another library
    second = kernel_build.build((src,), cache=str(cache))
    assert second is not None and second != first and first.exists()
