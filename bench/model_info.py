"""What the load generators need to know about a model directory, and building the default ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.venvs import ROOT
from ringserve.model_source import DEFAULT_MODEL, MODELS_DIR, SMOLLM2_DIR_NAME

MODELS = {"tiny": ROOT / ".cache/models/ringserve-tiny-llama", "100m": ROOT / ".cache/models/ringserve-100m-llama"}


def resolve(name: str) -> Path:
    """`tiny` / `100m` (built if missing, via ringserve.default_model), the default model's name
    (`smollm2-135m-instruct`: fetched and converted once, as `make run` does) or a model directory."""
    if name in MODELS:
        subprocess.run([sys.executable, "-m", "ringserve.default_model", "--shape", name], check=True, cwd=ROOT)
        return MODELS[name]
    if name == DEFAULT_MODEL:
        subprocess.run([sys.executable, "-m", "ringserve.model_source", name], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        return MODELS_DIR / SMOLLM2_DIR_NAME
    path = Path(name).resolve()
    if not (path / "config.json").exists():
        raise SystemExit(f"--models: {name} is neither tiny, 100m, {DEFAULT_MODEL} nor a model directory")
    return path


def vocab(model_dir: Path) -> tuple[int, set[int]]:
    """(vocab_size from config.json, ids of the tokenizer's special / added tokens)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    special: set[int] = set()
    tok_file = model_dir / "tokenizer.json"
    if tok_file.exists():
        special = {t["id"] for t in json.loads(tok_file.read_text()).get("added_tokens", [])}
    return int(cfg["vocab_size"]), special
