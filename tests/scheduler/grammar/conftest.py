"""Grammar fixtures: one xgrammar backend for the default model per session (import + tokenizer
load take seconds), and its text tokenizer for turning sampled ids back into strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringserve.text_tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def model_vocab(model_dir: str) -> tuple[int, list[int]]:
    """(logits width, EOS ids) as the model runner reads them (generation_config first)."""
    path = Path(model_dir)
    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    eos = cfg["eos_token_id"] if eos is None else eos
    return cfg["vocab_size"], eos if isinstance(eos, list) else [eos]


@pytest.fixture(scope="session")
def backend(model_dir: str, model_vocab: tuple[int, list[int]]):
    pytest.importorskip("xgrammar")
    from services.scheduler.grammar import load_backend

    vocab_size, eos = model_vocab
    return load_backend("xgrammar", model_dir, vocab_size, eos)


@pytest.fixture(scope="session")
def text_tokenizer(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(model_dir)
