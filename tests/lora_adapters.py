"""Random LoRA adapters made by peft for a model directory (init_lora_weights=False: B is not zero,
so every adapter changes the output)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out: Path, seed: int, r: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, scale: float = 1.0) -> str:
    """Save a random PEFT adapter to `out`; scale multiplies its B (the tiny model's random weights
    need a sizeable update for adapters to differ in greedy output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                     lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out))
    return str(out)


def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers (+ peft when adapter is given) greedy ids, exactly new_tokens each (EOS masked)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out
