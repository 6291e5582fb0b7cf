"""CUDA path: logits parity with the CPU fp32 reference, and CUDA-graph replay == eager.

Self-contained (builds the default model if needed); skipped without CUDA. On a GPU machine:
    .venv/bin/python -m pytest -q -m cuda tests/scheduler/test_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.model_executor.model_runner import ModelRunner

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Seq:
    def __init__(self, runner: ModelRunner, ids: list[int]) -> None:
        self.runner, self.ids, self.cached = runner, list(ids), 0
        self.row = runner.req_to_token_pool.alloc()

    def reserve(self, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool.alloc(n)
        self.runner.req_to_token_pool.req_to_token[self.row, self.cached:self.cached + n] = slots
        return slots


def make_batch(seqs: list[Seq], mode: ForwardMode, new: list[int], device: torch.device) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    locs: list[torch.Tensor] = []
    for s, n in zip(seqs, new):
        locs.append(s.reserve(n))
        ids += s.ids[s.cached:s.cached + n]
        pos += range(s.cached, s.cached + n)
    prefix = [s.cached for s in seqs]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    for s, n in zip(seqs, new):
        s.cached += n
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(mode=mode, input_ids=t(ids), positions=t(pos), out_cache_loc=torch.cat(locs),
                        req_pool_indices=t([s.row for s in seqs]), seq_lens=t(seq_lens),
                        extend_lens=list(new), prefix_lens=prefix, seq_lens_cpu=seq_lens)


def run_steps(runner: ModelRunner, prompts: list[list[int]], steps: int,
              eager: bool = False) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill, then `steps` greedy decode steps; returns per-step logits (CPU) and the tokens."""
    dev = runner.device
    seqs = [Seq(runner, p) for p in prompts]
    fwd = runner.forward_eager if eager else runner.forward
    logits = fwd(make_batch(seqs, ForwardMode.EXTEND, [len(p) for p in prompts], dev))
    toks: list[list[int]]
    all_logits, toks = [logits.float().cpu()], [[] for _ in prompts]
    for _ in range(steps):
        for s, o, t in zip(seqs, toks, logits.argmax(-1).tolist()):
            s.ids.append(t)
            o.append(t)
        logits = fwd(make_batch(seqs, ForwardMode.DECODE, [1] * len(seqs), dev))
        all_logits.append(logits.float().cpu())
    for s in seqs:
        runner.token_to_kv_pool.free(runner.req_to_token_pool.req_to_token[s.row, :s.cached])
        runner.req_to_token_pool.free(s.row)
    return all_logits, toks


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (3, 40, 17, 300, 9)]


@pytest.fixture(scope="module")
def model_path() -> str:
    from ringserve.default_model import DEFAULT_MODEL_DIR, build

    return str(build(DEFAULT_MODEL_DIR))


def test_fp32_cuda_matches_cpu_reference(model_path: str, prompts) -> None:
    cpu = ModelRunner(model_path, device="cpu", max_total_tokens=4096, max_running_requests=8)
    gpu = ModelRunner(model_path, device="cuda", dtype="float32", max_total_tokens=4096,
                      max_running_requests=8, cuda_graph_max_bs=8)
    assert gpu.cuda_graph_runner is not None
    ref, ref_toks = run_steps(cpu, prompts, 8)
    got, toks = run_steps(gpu, prompts, 8)  # decode steps replay graphs (bs 5 padded to 8)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=2e-3, rtol=0)  # TF32/accumulation order on the GPU
    assert toks == ref_toks


def test_bf16_close_to_cpu_reference(model_path: str, prompts) -> None:
    cpu = ModelRunner(model_path, device="cpu", max_total_tokens=4096, max_running_requests=8)
    gpu = ModelRunner(model_path, device="cuda", max_total_tokens=4096, max_running_requests=8)
    assert gpu.dtype == torch.bfloat16
    ref, _ = run_steps(cpu, prompts[:2], 1)
    got, _ = run_steps(gpu, prompts[:2], 1)
    for r, g in zip(ref, got):
        # bf16 weights: compare the distributions, not exact logits.
        assert torch.nn.functional.kl_div(g.log_softmax(-1), r.log_softmax(-1), log_target=True,
                                          reduction="batchmean") < 0.05


@pytest.mark.parametrize("bs", [1, 3, 8, 13])
def test_graph_replay_equals_eager(model_path: str, bs: int) -> None:
    # torch SDPA: its graphs are keyed by KV-length buckets, which this test crosses (Triton needs none).
    gpu = ModelRunner(model_path, device="cuda", max_total_tokens=16384, max_running_requests=16,
                      cuda_graph_max_bs=16, attention_backend="torch")
    g = torch.Generator().manual_seed(bs)
    # Lengths cross the first KV bucket (256) so a second bucket's graph is captured lazily.
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 300, (bs,), generator=g)]
    eager, eager_toks = run_steps(gpu, prompts, 6, eager=True)
    graph, graph_toks = run_steps(gpu, prompts, 6)
    for e, r in zip(eager, graph):
        torch.testing.assert_close(r, e, atol=1e-3, rtol=0)
    assert graph_toks == eager_toks
    assert len(gpu.cuda_graph_runner.graphs) > len(gpu.cuda_graph_runner.batch_sizes)  # lazy capture ran
    assert gpu.token_to_kv_pool.available_size() == 16384


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_families_on_cuda_match_cpu(model_path: str, family: str, prompts, tmp_path) -> None:
    """Windows (8 / 16) far shorter than the prompts: eager prefill masks and the graphs' static window
    masks in decode give the CPU reference's logits and tokens."""
    from tests.random_models import build_windowed

    path = str(build_windowed(family, tmp_path / family, model_path))
    cpu = ModelRunner(path, device="cpu", max_total_tokens=4096, max_running_requests=8)
    gpu = ModelRunner(path, device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8,
                      cuda_graph_max_bs=8)
    assert gpu.attention_backend == "torch"  # the default (triton) has no windows: SDPA serves instead
    assert gpu.cuda_graph_runner is not None and gpu.cuda_graph_runner.window_masks
    ref, ref_toks = run_steps(cpu, prompts, 8)
    got, toks = run_steps(gpu, prompts, 8)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=2e-3, rtol=0)
    assert toks == ref_toks
