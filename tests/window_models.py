"""Random-weight models with sliding-window attention, for parity tests against transformers.

Each is a real transformers checkpoint of a few layers (GQA, windows far shorter than the prompts the
tests send) with the tiny default model's tokenizer, so the engine and the four processes serve it
like any model directory. Built once per test session from a fixed seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
COMMON = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
FAMILIES: dict[str, dict[str, Any]] = {
    # Two local layers (window 8, RoPE base 10k) around a global one (base 1M): Gemma 3's pattern.
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=3,
                   head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # Every layer windowed.
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], num_hidden_layers=3, head_dim=16,
                    sliding_window=16),
}


def build(family: str, out: Path, tokenizer_dir: str) -> Path:
    """A random `family` checkpoint in `out` (float32 safetensors) with the tokenizer of `tokenizer_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**COMMON, **FAMILIES[family]}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms, so that a norm applied wrong changes the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out
