"""Greedy parity: the engine's tokens equal transformers `generate(do_sample=False)` token for token.

Many concurrent prompts of mixed lengths (shared prefixes, CJK text) run three ways: plain, with
16-token prefill chunks, and with a KV pool so small that requests are retracted and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.kernels.cpu_linear import PackedLinear
from services.scheduler.model_executor.sampling import SamplingParams

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！这是一个关于缓存和调度的测试。",
    "東京は日本の首都です。今日はいい天気ですね。",
    "def step(self):\n    batch = self.schedule()\n    return self.run(batch)",
    "서울의 밤하늘에는 별이 많이 보이지 않습니다.",
    "Once upon a time",
    "a",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
SHARED = "System: you are a helpful assistant. 请用中文回答下面的问题，并且保持简洁。 User: "


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tok = TextTokenizer.from_model(model_dir)
    out = []
    for i in range(32):
        text = TEXTS[i % len(TEXTS)] * (1 + i % 3)
        if i % 2 == 0:
            text = SHARED + text  # shared prefix: radix hits across the batch
        out.append(tok.encode(text))
    assert len({len(p) for p in out}) > 10
    return out


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(model_dir)
    eos = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
    refs: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(i)
    with torch.no_grad():
        # Prompts of equal length batch without padding, so nothing but the math can differ.
        for n, rows in by_len.items():
            batch = torch.tensor([prompts[i] for i in rows])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=sorted(eos), pad_token_id=0)
            for i, seq in zip(rows, out[:, n:].tolist()):
                # A finished row keeps going with padding in a batch: cut after its EOS.
                end = next((k + 1 for k, t in enumerate(seq) if t in eos), len(seq))
                refs[i] = seq[:end]
    return refs


def run(model_dir: str, prompts: list[list[int]], **cfg) -> tuple[list[list[int]], Engine]:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", **cfg))
    results = engine.generate(prompts, GREEDY)
    engine.tree.check()
    return [r.output_ids for r in results], engine


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} prompts differ; first {bad[0]}: got {got[bad[0]]}, want {want[bad[0]]}"


@pytest.mark.parametrize("plain_torch", [False, True], ids=["cpu-kernels", "plain-torch"])
def test_greedy_parity(model_dir: str, prompts, reference, plain_torch: bool) -> None:
    # Both CPU forwards: oneDNN-packed linears + the C decode kernel (where available), and stock torch.
    got, engine = run(model_dir, prompts, max_total_tokens=8192, max_running_requests=64,
                      disable_cpu_kernels=plain_torch)
    assert_same(got, reference)
    if plain_torch:
        assert engine.runner.attn_backend.native is None
        assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())


def test_greedy_parity_chunked_prefill(model_dir: str, prompts, reference) -> None:
    got, engine = run(model_dir, prompts, max_total_tokens=8192, max_running_requests=64,
                      chunked_prefill_size=16)
    assert_same(got, reference)
    assert engine.scheduler.stats.prefill_steps > len(prompts) // 2  # prompts really went in chunks


@pytest.mark.parametrize("plain_torch", [False, True], ids=["cpu-kernels", "plain-torch"])
def test_greedy_parity_mixed_chunk(model_dir: str, prompts, reference, plain_torch: bool) -> None:
    # Small prefill steps: the prompts go in over many steps, and the running requests decode inside them.
    got, engine = run(model_dir, prompts, max_total_tokens=8192, max_running_requests=64, enable_mixed_chunk=True,
                      chunked_prefill_size=16, max_prefill_tokens=48, disable_cpu_kernels=plain_torch)
    assert_same(got, reference)
    assert engine.scheduler.stats.mixed_steps > 10


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
def test_greedy_parity_with_retraction(model_dir: str, prompts, reference, mixed: bool) -> None:
    longest = max(len(p) for p in prompts) + MAX_NEW
    got, engine = run(model_dir, prompts, max_total_tokens=longest + 256, max_running_requests=64,
                      enable_mixed_chunk=mixed)
    assert_same(got, reference)
    assert engine.scheduler.stats.retractions > 0
    # Everything released: the pool holds only what the radix cache keeps.
    assert engine.kv.kv_pool.available_size() + engine.tree.total_size() == engine.kv.size
    assert engine.tree.protected_size() == 0
