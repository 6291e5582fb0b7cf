"""Importing the scheduler package turns on torch's transparent huge pages, unless already set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import services.scheduler, os, re, torch
before = int(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))
x = torch.ones(8 << 20)  # 32 MiB
after = int(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))
print(os.environ["THP_MEM_ALLOC_ENABLE"], after - before)
"""


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return re.search(r"\[(\w+)\]", text).group(1)


def probe(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs THP in madvise mode (with 'always' every page is huge)")
def test_big_tensors_get_huge_pages_in_a_scheduler_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    setting, huge_kb = probe(env)
    assert setting == "1" and huge_kb >= 2048  # at least one 2 MiB page (fragmentation may deny some)
    setting, huge_kb = probe({**env, "THP_MEM_ALLOC_ENABLE": "0"})  # an explicit setting wins
    assert setting == "0" and huge_kb == 0


def test_an_explicit_setting_is_kept() -> None:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}
    code = "import services.scheduler, os; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "0"
