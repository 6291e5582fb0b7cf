"""The default model builds deterministically, offline, and loads like any HF Llama."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ringserve.default_model import ModelShape, build
from ringserve.text_tokenizer import TextTokenizer

SMALL = ModelShape(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build(tmp_path / "a", SMALL)
    b = build(tmp_path / "b", SMALL)
    assert digest(a) == digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(digest(a))


def test_second_build_is_a_no_op(tmp_path: Path) -> None:
    out = build(tmp_path / "m", SMALL)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build(out, SMALL)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_tokenizer_splits_multibyte_characters(model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    ids = tok.encode("龘 🧬 ñ", add_special_tokens=False)
    pieces = tok.token_texts(ids)
    assert tok.decode(ids) == "龘 🧬 ñ"
    assert any("\ufffd" in p for p in pieces), pieces  # some character spans several tokens
    assert tok.eos_token_ids and tok.chat_template


def test_loads_with_transformers(model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = model.generate(torch.tensor([[0, 5, 6]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
