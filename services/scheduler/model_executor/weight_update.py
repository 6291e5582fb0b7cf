"""Weights from disk into the running model, in place (SGLang's update_weights_from_disk).

Everything is checked before the first byte is copied, so a refused update leaves the old weights
untouched: the new config must describe the same model (architecture and every field that shapes
or changes the computation), and every checkpoint tensor must name a parameter of ours with the
right shape, none missing. The copy then goes into the existing parameter storage: CUDA graphs and
the attention backend keep pointing at the same tensors; only the CPU linears' packed copies are
rebuilt. Only safetensors are read (no pickle).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ringserve.model_source import safetensors_files
from services.scheduler.kernels import cpu_linear
from services.scheduler.model_executor import model_loader
from services.scheduler.model_executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

LOAD_FORMATS = ("", "auto", "safetensors")
# Config keys that say nothing about the computation (provenance, runtime preferences).
_IGNORED_KEYS = {"_name_or_path", "torch_dtype", "dtype", "transformers_version", "_commit_hash",
                 "use_cache", "_attn_implementation_autoset", "architectures"}


class WeightUpdateError(ValueError):
    """The new weights do not fit the running model; the message names the file, field or tensor."""


def _check_config(current: dict, path: Path) -> None:
    """Both configs as transformers reads them (so that spelling differences of one value, e.g.
    rope_theta inside rope_parameters, compare equal)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise WeightUpdateError(f"{cfg_file}: not found")
    try:
        new = model_loader.load_config(path).to_dict()
    except (OSError, ValueError) as e:
        raise WeightUpdateError(f"{cfg_file}: unreadable ({e})") from None
    if new.get("architectures") != current.get("architectures"):
        raise WeightUpdateError(f"{cfg_file}: architectures {new.get('architectures')} differ from the served "
                                f"{current.get('architectures')}")
    for key in sorted((set(current) | set(new)) - _IGNORED_KEYS):
        if new.get(key) != current.get(key):
            raise WeightUpdateError(f"{cfg_file}: {key} is {new.get(key)!r}, the served model has {current.get(key)!r}")


def check(runner: ModelRunner, model_path: str) -> list[Path]:
    """Raise WeightUpdateError unless model_path holds weights for exactly the served model; returns
    the safetensors files. Reads only headers (shapes), not tensors."""
    from safetensors import safe_open

    path = Path(model_path)
    if not path.is_dir():
        raise WeightUpdateError(f"model_path: {model_path!r} is not a directory")
    _check_config(runner.model_config.to_dict(), path)
    try:
        files = safetensors_files(path)
    except FileNotFoundError as e:
        raise WeightUpdateError(str(e)) from None
    model = runner.model
    params = dict(model.named_parameters())
    seen: set[tuple[str, int | None]] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = model.weight_target(name)
                if target is None:
                    continue
                if target[0] not in params:
                    raise WeightUpdateError(f"{file.name}: tensor {name} is not a weight of the served model")
                want = model.expected_shape(target, params)
                got = tuple(f.get_slice(name).get_shape())
                if got != want:
                    raise WeightUpdateError(f"{file.name}: tensor {name} has shape {list(got)}, "
                                            f"the served model needs {list(want)}")
                seen.add(target)
    missing = model.missing_weights(seen)
    if missing:
        raise WeightUpdateError(f"{path}: weights missing: {', '.join(missing[:5])}")
    return files


def load_in_place(runner: ModelRunner, model_path: str) -> None:
    """Check, then copy the new weights into the model's parameters (callers hold the engine's
    step lock: nothing runs meanwhile)."""
    check(runner, model_path)
    path = Path(model_path)
    runner.model.load_weights(model_loader.iter_weights(path))
    n = cpu_linear.repack_linears(runner.model)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    runner.model_path = model_path
    log.info("weights updated in place from %s (%d packed linears rebuilt)", model_path, n)
