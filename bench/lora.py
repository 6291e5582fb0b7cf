"""`--lora N`: the served targets with N random LoRA adapters, every request on one of them.

The adapters are random (rank 8 on every projection) in PEFT's file layout, written from the model's
config.json; the throughput cost of LoRA does not depend on what the weights hold. bench_serving
sends them in turn (`--lora-request-distribution distinct`), as `model` and `lora_path`.
"""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: Path, n: int, out: Path) -> list[tuple[str, str]]:
    """(name, path) of n adapters for model_dir under out (rewritten each run: cheap)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    q, kv = heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    made = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for m in TARGETS:
                d_in, d_out = dims[m]
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g) / d_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g) * 0.01
        path = out / f"lora{k}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}))
        made.append((f"lora{k}", str(path)))
    return made
