"""Random LoRA adapters made by peft for a model directory (init_lora_weights=False: B is not zero,
so every adapter changes the output)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_peft_model(model_dir: str, seed: int, r: int = 8, alpha: int = 16, targets: list[str] | None = None,
                      scale: float = 1.0) -> Any:
    """The model with a random PEFT adapter (in memory); scale multiplies its B (the tiny model's random
    weights need a sizeable update for adapters to differ in greedy output)."""
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
    return peft_model


def make_adapter(model_dir: str, out: Path, seed: int, r: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, scale: float = 1.0) -> str:
    """Save a random PEFT adapter (random_peft_model) to `out`."""
    random_peft_model(model_dir, seed, r, alpha, targets, scale).save_pretrained(str(out))
    return str(out)


def greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """A transformers (or peft) model's greedy ids, exactly new_tokens each (EOS masked), on one thread:
    with the stack's processes on the same cores, torch's thread pool would wait on descheduled threads."""
    import torch

    model.eval()
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids])
                gen = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                out.append(gen[0, len(ids):].tolist())
    finally:
        torch.set_num_threads(threads)
    return out
