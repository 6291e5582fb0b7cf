"""--synthetic-forward: the engine's real scheduling and pools, with fixed tokens in place of the model."""

from __future__ import annotations

import torch

from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.model_executor.model_runner import SYNTHETIC_LOW_ID, synthetic_tokens
from services.scheduler.model_executor.sampling import SamplingParams


def test_tokens_avoid_eos_and_low_ids() -> None:
    ids = torch.arange(0, 5000)
    pos = torch.arange(5000, 0, -1)
    out = synthetic_tokens(ids, pos, vocab_size=1000, eos_token_ids=[300, 999])
    assert out.min() >= SYNTHETIC_LOW_ID and out.max() < 1000
    assert not torch.isin(out, torch.tensor([300, 999])).any()
    assert len(set(out.tolist())) > 500  # spread over the vocabulary, not one token


def test_engine_emits_synthetic_tokens(model_dir: str) -> None:
    threads = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig(model=model_dir, device="cpu", synthetic_forward=True,
                                     chunked_prefill_size=16))
        # One CPU thread: no OpenMP worker left to spin on a core the benchmarked services need.
        assert torch.get_num_threads() == 1 and engine.runner.prefill_threads == engine.runner.decode_threads == 1
    finally:
        torch.set_num_threads(threads)  # torch's count is process-wide: the next tests keep theirs
    prompts = [list(range(300, 340)), list(range(500, 507)), list(range(500, 507))]
    outs = [r.output_ids for r in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))]
    assert [len(o) for o in outs] == [12, 12, 12]  # never EOS: every request runs to max_new_tokens
    assert outs[1] == outs[2]  # a fixed function of the sequence: the same prompt, the same tokens
    eos = set(engine.runner.eos_token_ids)
    assert not eos.intersection(t for o in outs for t in o)
    # the first token follows the prompt's last token and position, as every later one does
    want = synthetic_tokens(torch.tensor([339]), torch.tensor([39]), engine.runner.vocab_size, list(eos))
    assert outs[0][0] == int(want[0])


def test_greedy_decode_steps_get_the_tokens_the_logits_would_give(model_dir: str) -> None:
    """A greedy decode batch gets the [B] tokens without the [B, V] logits; any other batch gets logits
    whose argmax is those tokens, so sampled and greedy requests see the same sequence."""
    threads = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig(model=model_dir, device="cpu", synthetic_forward=True))
    finally:
        torch.set_num_threads(threads)
    runner = engine.runner
    ids, pos = torch.tensor([400, 401, 402]), torch.tensor([7, 8, 9])
    batch = ForwardBatch(ForwardMode.DECODE, ids, pos, out_cache_loc=torch.zeros(3, dtype=torch.int64),
                         req_pool_indices=torch.arange(3), seq_lens=pos + 1, extend_lens=[1, 1, 1],
                         prefix_lens=[7, 8, 9], seq_lens_cpu=[8, 9, 10])
    logits = runner.forward(batch)
    assert logits.shape == (3, runner.vocab_size)
    batch.greedy = True
    got = runner.forward(batch)
    assert got.shape == (3,) and torch.equal(got, logits.argmax(dim=1))
    # greedy and sampled requests alike: the same tokens through the engine
    prompts = [list(range(300, 310))] * 2
    greedy, sampled = (engine.generate([p], SamplingParams(temperature=t, max_new_tokens=6))[0].output_ids
                       for p, t in zip(prompts, (0.0, 0.8)))
    assert greedy == sampled
