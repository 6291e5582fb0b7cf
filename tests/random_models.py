"""Small random-weight checkpoints of every served architecture, for parity tests against transformers.

Each is written by transformers' own save_pretrained (so the loader reads what transformers writes),
with the tiny test model's tokenizer (vocab 4096): 3 layers, hidden 64, GQA (4 query heads, 2 KV
heads), and for the MoE models 8 experts with top-2 routing. Norm weights and biases are perturbed
so that a block that is skipped or misplaced changes the logits.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

_BASE: dict[str, Any] = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)

# architectures name -> (model_type, what differs from _BASE)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {}),
    "MistralForCausalLM": ("mistral", dict(head_dim=24, sliding_window=None)),
    "Qwen2ForCausalLM": ("qwen2", {}),
    "Qwen3ForCausalLM": ("qwen3", dict(head_dim=32)),
    # Mixtral: top-k always renormalised.
    "MixtralForCausalLM": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96,
                                           sliding_window=None)),
    # Qwen3-MoE: renormalised top-k, and layer 1 a dense MLP (mlp_only_layers).
    "Qwen3MoeForCausalLM": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                              norm_topk_prob=True, head_dim=32, mlp_only_layers=[1])),
    # Qwen2-MoE: top-k not renormalised, a shared expert with its sigmoid gate.
    "Qwen2MoeForCausalLM": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                              shared_expert_intermediate_size=96, norm_topk_prob=False)),
    # Gemma 3: two local layers (window 8, RoPE base 10k) around a global one (base 1M); the prompts of
    # the parity tests are longer than the window.
    "Gemma3ForCausalLM": ("gemma3_text", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                              rope_parameters={
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    # Phi-3 128k-style longrope with partial rotary (Phi-4-mini); prompts stay below the original length,
    # where transformers uses the short factors (rotary.py: why the long ones are per position here).
    "Phi3ForCausalLM": ("phi3", dict(partial_rotary_factor=0.5, original_max_position_embeddings=256,
                                     rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 256,
                                                   "short_factor": [1.0, 1.3, 1.7, 2.2],
                                                   "long_factor": [2.0, 3.5, 5.0, 9.0]})),
}


# The sliding-window tests' models, by name: Gemma 3 as above (window 8 on its local layers), and
# Mistral with a window of 16 on every layer; both far shorter than the prompts those tests send.
WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3ForCausalLM", {}),
    "mistral": ("MistralForCausalLM", dict(head_dim=16, sliding_window=16)),
}


def hf_config(arch: str, **overrides: Any):
    from transformers import AutoConfig

    model_type, extra = CONFIGS[arch]
    return AutoConfig.for_model(model_type, architectures=[arch], **{**_BASE, **extra, **overrides})


def build(arch: str, out: Path, tokenizer_dir: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a random `arch` checkpoint with the tokenizer of `tokenizer_dir` into `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(tokenizer_dir) / f).exists():
            shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out


def build_windowed(name: str, out: Path, tokenizer_dir: str) -> Path:
    """The WINDOWED model `name`, as `build` writes it."""
    arch, overrides = WINDOWED[name]
    return build(arch, out, tokenizer_dir, **overrides)
