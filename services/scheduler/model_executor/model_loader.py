"""Find a model (local dir or hub id), read its config, and stream its safetensors weights.

Only safetensors are read: no pickle-based `.bin` checkpoints.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from ringserve.model_source import resolve_model, safetensors_files

logger = logging.getLogger(__name__)

def resolve_model_path(model_path: str) -> Path:
    """The model directory (ringserve.model_source: a GGUF is converted here if it was not yet)."""
    return resolve_model(model_path, prepare=True)


def load_config(path: Path):
    """The HF config (`transformers.PretrainedConfig`) of the model dir."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def load_eos_token_ids(path: Path, config) -> list[int]:
    """EOS ids from generation_config.json (a list for chat models), else from config.json."""
    eos = None
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of every shard, one shard open at a time."""
    from safetensors import safe_open

    files = safetensors_files(path)
    for i, file in enumerate(files):
        logger.info("loading weights: shard %d/%d %s", i + 1, len(files), file.name)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
