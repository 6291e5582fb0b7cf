"""One family per stack, through the four real processes: a mixture-of-experts model (Qwen3-MoE) and
Phi-3 (longrope, partial rotary) on small random checkpoints answer 10 concurrent greedy requests, their
prompts prefilled in 16-token chunks, with exactly transformers' `generate` tokens."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import pytest

from services.scheduler.models import ARCHITECTURES
from tests.e2e.reference import PROMPTS, greedy_body, greedy_reference
from tests.e2e.stack import running_stack
from tests.random_models import build

pytestmark = pytest.mark.e2e
NEW = 8


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Phi3ForCausalLM"])
def test_family_greedy_equals_transformers_concurrent_and_chunked(arch: str, model_dir: str,
                                                                  tmp_path: Path) -> None:
    path = str(build(arch, tmp_path / arch, model_dir))
    reference = greedy_reference(path, PROMPTS, NEW)
    with running_stack(path, "--scheduler-args", "--chunked-prefill-size 16") as stack:
        bodies = [greedy_body(p, NEW) for p in PROMPTS]  # 10 concurrent requests, two share a prefix
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            outs = list(pool.map(stack.generate, bodies))
        for body, out in zip(bodies, outs):
            assert out["output_ids"] == reference[body["text"]], body["text"]
        info = httpx.get(f"{stack.gateway_url}/get_model_info", timeout=10).json()
        assert info["architectures"] == [arch]  # the scheduler's model class, through the tokenizer
        assert info["supported_architectures"] == sorted(ARCHITECTURES)
