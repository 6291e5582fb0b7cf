"""CUDA-graph capture/replay logic on CPU with the torch SDPA backend: emulated graphs (cuda_graph.py)
rerun the captured function over the static buffers, so padding rows, the KV-length buckets (lazy
capture past the first) and the static metadata are exercised without a GPU. The Triton backend's
variant is in tests/scheduler/attention/test_triton_backend.py; tests/scheduler/test_cuda.py runs real
graphs on a GPU."""

from __future__ import annotations

import torch

from services.scheduler.model_executor.cuda_graph import MIN_KV_BUCKET
from services.scheduler.model_executor.forward_batch import ForwardMode
from services.scheduler.model_executor.model_runner import ModelRunner
from tests.scheduler.test_model_runner import Seq, make_batch


def decode_run(r: ModelRunner, prompts: list[list[int]], steps: int, eager: bool) -> list[torch.Tensor]:
    fwd = r.forward_eager if eager else r.forward
    seqs = [Seq(r, p) for p in prompts]
    out = [fwd(make_batch(seqs, ForwardMode.EXTEND, [len(p) for p in prompts]))]
    for _ in range(steps):
        for s, t in zip(seqs, out[-1].argmax(-1).tolist()):
            s.ids.append(t)
        out.append(fwd(make_batch(seqs, ForwardMode.DECODE, [1] * len(seqs))))
    for s in seqs:
        r.token_to_kv_pool.free(r.req_to_token_pool.req_to_token[s.row, :s.cached])
        r.req_to_token_pool.free(s.row)
    return out


def test_emulated_graphs_equal_eager_across_buckets(model_dir: str) -> None:
    r = ModelRunner(model_dir, device="cpu", max_total_tokens=2048, max_running_requests=4,
                    attention_backend="torch", emulate_cuda_graph=True, cuda_graph_max_bs=4)
    graphs = r.cuda_graph_runner
    assert graphs is not None and sorted(graphs.graphs) == [(1, MIN_KV_BUCKET), (2, MIN_KV_BUCKET), (4, MIN_KV_BUCKET)]
    # 3 requests (bs 4 with a padding row), one of them past the first bucket: a second graph is captured.
    prompts = [list(range(1, 8)), list(range(5, 5 + MIN_KV_BUCKET + 3)), list(range(9, 40))]
    eager = decode_run(r, prompts, 2, eager=True)
    replayed = decode_run(r, prompts, 2, eager=False)
    for e, g in zip(eager, replayed):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert (4, 2 * MIN_KV_BUCKET) in graphs.graphs
    assert r.token_to_kv_pool.available_size() == 2048


def test_emulated_graphs_keep_each_layers_window(model_dir: str, tmp_path) -> None:
    """Gemma 3's local layers (window 8) replay over their own static masks, refilled every step."""
    from tests.random_models import build_windowed

    path = str(build_windowed("gemma3", tmp_path / "gemma3", model_dir))
    r = ModelRunner(path, device="cpu", max_total_tokens=1024, max_running_requests=4,
                    attention_backend="torch", emulate_cuda_graph=True, cuda_graph_max_bs=4)
    assert r.cuda_graph_runner is not None and list(r.cuda_graph_runner.window_masks) == [8]
    prompts = [list(range(5, 35)), list(range(9, 20)), list(range(40, 43))]
    eager = decode_run(r, prompts, 3, eager=True)
    replayed = decode_run(r, prompts, 3, eager=False)
    for e, g in zip(eager, replayed):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
