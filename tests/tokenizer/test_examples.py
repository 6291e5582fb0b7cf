"""The examples against a live tokenizer: python_client.py, and node/client.js (grpc-js + proto-loader
on ../../protos only) when node and npm exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .fakes import fake_text

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "node"
# Dependencies go to a git-ignored cache, not into examples/node.
NODE_CACHE = ROOT / ".cache" / "node-client"

needs_node = pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")), reason="node/npm not installed")


def test_python_client_streams_a_generation(ring, tokenizer):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python_client.py"), "--target",
                           tokenizer.cfg.address, "--prompt", "hello world", "--max-new-tokens", "6"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = fake_text(ring.tokenizer.encode("hello world"), 6)
    assert proc.stdout.startswith(expected) and "finish=length" in proc.stdout


@pytest.fixture(scope="module")
def node_modules() -> Path:
    NODE_CACHE.mkdir(parents=True, exist_ok=True)
    manifest = (EXAMPLE / "package.json").read_text()
    modules = NODE_CACHE / "node_modules"
    if (NODE_CACHE / "package.json").exists() and (NODE_CACHE / "package.json").read_text() == manifest \
            and (modules / "@grpc" / "grpc-js").exists():
        return modules
    (NODE_CACHE / "package.json").write_text(manifest)
    try:
        proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=NODE_CACHE,
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install timed out (offline?)")
    if proc.returncode != 0:
        pytest.skip(f"npm install failed (offline?): {proc.stderr[-500:]}")
    return modules


@needs_node
def test_node_client_streams_a_generation(ring, tokenizer, node_modules):
    env = {**os.environ, "NODE_PATH": str(node_modules)}
    proc = subprocess.run(["node", str(EXAMPLE / "client.js"), "--target", tokenizer.cfg.address,
                           "--prompt", "hello world", "--max-new-tokens", "7", "--timeout", "20"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = fake_text(ring.tokenizer.encode("hello world"), 7)
    assert summary["text"] == expected and summary["finish_reason"] == "length"
    assert summary["completion_tokens"] == 7 and summary["prompt_tokens"] == len(ring.tokenizer.encode("hello world"))
    assert proc.stdout.startswith(expected)
