"""Private virtual environments under .cache/bench, created once (a stamp file records what was
installed; a changed package list reinstalls)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def ensure_venv(name: str, packages: list[str], uninstall: Sequence[str] = ()) -> Path:
    """Python of .cache/bench/<name> with `packages` installed (then `uninstall` removed)."""
    venv = CACHE / name
    py = venv / "bin" / "python"
    stamp = venv / ".bench-installed"
    want = {"packages": packages, "uninstall": list(uninstall)}
    if stamp.exists() and py.exists() and json.loads(stamp.read_text()) == want:
        return py
    t0 = time.monotonic()
    log(f"creating {venv} with {' '.join(packages)} (once; progress below)")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--progress-bar", "on", *packages], check=True)
    if uninstall:
        subprocess.run([*pip, "uninstall", "-y", *uninstall], check=False)
    stamp.write_text(json.dumps(want))
    log(f"{name} ready in {time.monotonic() - t0:.0f}s")
    return py
