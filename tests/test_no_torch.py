"""The gateway, tokenizer and detokenizer images carry no torch: their entry points never import it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("entry", ["gateway.__main__", "services.tokenizer.__main__",
                                   "services.detokenizer.__main__"])
def test_entry_point_does_not_import_torch(entry: str) -> None:
    code = (f"import sys, importlib; importlib.import_module({entry!r}); "
            "bad = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{entry} imported {out.stdout.strip()}\n{out.stderr[-2000:]}"
