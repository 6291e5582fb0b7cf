"""One LoRA adapter in PEFT's format, read, checked and mapped onto the fused projections.

PEFT names its tensors after the HF modules (`...layers.3.self_attn.q_proj.lora_A.weight`, A: [r, in],
B: [out, r]); our Llama fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so each HF
target becomes one slice of a fused module's output columns. The scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rslora) is folded into B once here, per module (rank_pattern can give
modules different ranks).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# HF module name -> (our fused module, slice index). Slices are stacked along the output in this order.
HF_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
FUSED_SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
# What --lora-target-modules accepts: HF names, our fused names, or "all".
_ALIASES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter this server cannot serve; the message names the adapter and the problem."""


def expand_targets(names: list[str] | tuple[str, ...]) -> frozenset[str]:
    """--lora-target-modules -> the HF module names it covers ("all": every one)."""
    out: set[str] = set()
    for n in names:
        if n == "all":
            out.update(HF_TARGETS)
        elif n in _ALIASES:
            out.update(_ALIASES[n])
        elif n in HF_TARGETS:
            out.add(n)
        else:
            raise ValueError(f"--lora-target-modules: {n!r} is not one of all, "
                             f"{', '.join([*HF_TARGETS, *_ALIASES])}")
    return frozenset(out)


@dataclass
class LoraWeights:
    """An adapter's tensors on the host, keyed by (layer, HF module): A [r, in], B [out, r] with the
    scaling folded in."""

    name: str
    path: str
    rank: int                                    # the largest module rank
    targets: frozenset[str]                      # HF module names it adapts
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def read_config(path: Path, name: str) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"adapter {name!r}: {cfg_file} not found (a PEFT adapter directory has "
                           "adapter_config.json and adapter_model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {cfg_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {name!r}: {cfg_file} is not a JSON object")
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        problems.append("use_dora (DoRA is not supported)")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias {cfg.get('bias')!r} (only none)")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg.get('modules_to_save')}")
    if cfg.get("alpha_pattern"):
        problems.append("alpha_pattern")
    if problems:
        raise AdapterError(f"adapter {name!r}: unsupported adapter_config.json settings: {'; '.join(problems)}")
    return cfg


def load_adapter(name: str, path: str, *, num_layers: int, dims: dict[str, tuple[int, int]],
                 allowed: frozenset[str], max_rank: int) -> LoraWeights:
    """Read and check an adapter. dims: HF module -> (in_features, out_features) of the base model.
    AdapterError names what is wrong (missing files, unsupported settings, shapes, rank, targets)."""
    p = Path(path)
    cfg = read_config(p, name)
    st = p / "adapter_model.safetensors"
    if not st.is_file():
        raise AdapterError(f"adapter {name!r}: {st} not found (only safetensors adapters are read)")
    try:
        raw = load_file(str(st), device="cpu")
    except Exception as e:  # safetensors raises its own error types for a broken file
        raise AdapterError(f"adapter {name!r}: {st}: {e}") from None
    try:
        alpha = float(cfg.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise AdapterError(f"adapter {name!r}: lora_alpha {cfg.get('lora_alpha')!r} is not a number") from None
    rslora = bool(cfg.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                               f"layer's {', '.join(HF_TARGETS)} (embedding and lm_head adapters are not supported)")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in HF_TARGETS:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} targets {module!r}, "
                               f"not one of {', '.join(HF_TARGETS)}")
        if module not in allowed:
            raise AdapterError(f"adapter {name!r} targets {module!r}, which this server was not started for "
                               f"(--lora-target-modules: {', '.join(sorted(allowed))})")
        if not 0 <= layer < num_layers:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} names layer {layer}; the model has {num_layers}")
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise AdapterError(f"adapter {name!r}: {st} holds no LoRA weights")
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"].float(), ab["B"].float()   # A [r, in], B [out, r]
        d_in, d_out = dims[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise AdapterError(f"adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                               f"{tuple(b.shape)} do not fit the model ([r, {d_in}] / [{d_out}, r]); "
                               "an adapter for another model?")
        if r > max_rank:
            raise AdapterError(f"adapter {name!r}: rank {r} is above --max-lora-rank {max_rank}")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        tensors[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoraWeights(name, path, rank, frozenset(m for _, m in tensors), tensors)


def parse_lora_paths(items: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """--lora-paths NAME=PATH ... (SGLang's form; a bare PATH is named after itself) -> (name, path)."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        name, path = (name.strip(), path.strip()) if sep else (item.strip(), item.strip())
        if not name or not path:
            raise ValueError(f"--lora-paths: {item!r} is not NAME=PATH")
        if any(n == name for n, _ in out):
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        out.append((name, path))
    return out


def peek_rank(path: str, name: str) -> int:
    """The highest rank an adapter's config declares (r, and rank_pattern's values)."""
    cfg = read_config(Path(path), name)
    try:
        return max([int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    except (TypeError, ValueError, AttributeError):
        raise AdapterError(f"adapter {name!r}: r / rank_pattern in adapter_config.json are not integers") from None
