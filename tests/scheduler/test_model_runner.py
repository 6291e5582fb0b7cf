"""ModelRunner through the KV pools vs transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.model_executor.model_runner import ModelRunner

ATOL = 1e-4
BF16_KV_ATOL = 0.2  # the 4.5M model's logits read through bf16 keys and values: measured 0.039 largest


class Seq:
    """The bookkeeping S2's scheduler does, reduced to what a test needs."""

    def __init__(self, runner: ModelRunner, ids: list[int]) -> None:
        self.runner = runner
        self.ids = list(ids)
        self.row = runner.req_to_token_pool.alloc()
        self.cached = 0  # tokens whose K/V are in the pool

    def reserve(self, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool.alloc(n)
        assert slots is not None
        self.runner.req_to_token_pool.req_to_token[self.row, self.cached:self.cached + n] = slots
        return slots


def make_batch(seqs: list[Seq], mode: ForwardMode, new: list[int]) -> ForwardBatch:
    """`new[i]` = number of seqs[i].ids not yet cached that run in this pass."""
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
    return ForwardBatch(
        mode=mode, input_ids=torch.tensor(ids), positions=torch.tensor(pos), out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor([s.row for s in seqs]), seq_lens=torch.tensor(seq_lens),
        extend_lens=list(new), prefix_lens=prefix, seq_lens_cpu=seq_lens)


@pytest.fixture(scope="module")
def runner(model_dir: str) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", max_total_tokens=4096, max_running_requests=16)


@pytest.fixture(scope="module")
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def test_attributes(runner: ModelRunner) -> None:
    assert runner.vocab_size == 4096 and runner.context_length == 2048
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"
    assert runner.max_total_num_tokens == 4096 == runner.token_to_kv_pool.size
    assert len(runner.eos_token_ids) == 2
    runner.warmup()
    assert runner.token_to_kv_pool.available_size() == 4096


def test_extend_prefix_and_decode_match_transformers(runner: ModelRunner, hf_model) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (17, 5, 40)]
    seqs = [Seq(runner, p) for p in prompts]
    free0 = runner.token_to_kv_pool.available_size()

    # 1. Mixed-length prefill, but the third request only prefills 30 of its 40 tokens (a chunk).
    logits = runner.forward(make_batch(seqs, ForwardMode.EXTEND, [17, 5, 30]))
    assert logits.shape == (3, 4096) and logits.dtype == torch.float32
    for i, ids in enumerate([prompts[0], prompts[1], prompts[2][:30]]):
        torch.testing.assert_close(logits[i], hf_last_logits(hf_model, ids), atol=ATOL, rtol=0)

    # 2. EXTEND after a cached prefix: the rest of request 2, and new text appended to request 0.
    seqs[0].ids += torch.randint(0, 4096, (6,), generator=g).tolist()
    logits = runner.forward(make_batch([seqs[2], seqs[0]], ForwardMode.EXTEND, [10, 6]))
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, seqs[2].ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, seqs[0].ids), atol=ATOL, rtol=0)

    # 3. Several decode steps of all three, feeding back the argmax.
    next_ids = [int(hf_last_logits(hf_model, s.ids).argmax()) for s in seqs]
    for _ in range(5):
        for s, t in zip(seqs, next_ids):
            s.ids.append(t)
        logits = runner.forward(make_batch(seqs, ForwardMode.DECODE, [1, 1, 1]))
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], hf_last_logits(hf_model, s.ids), atol=ATOL, rtol=0)
        next_ids = logits.argmax(-1).tolist()

    used = sum(s.cached for s in seqs)
    assert runner.token_to_kv_pool.available_size() == free0 - used
    for s in seqs:
        runner.token_to_kv_pool.free(runner.req_to_token_pool.req_to_token[s.row, :s.cached])
        runner.req_to_token_pool.free(s.row)
    assert runner.token_to_kv_pool.available_size() == free0


def test_greedy_30_steps_match_generate(runner: ModelRunner, hf_model, model_dir: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    texts = ["def main():\n    return", "你好，世界！今天", "import os\nimport sys\n", "👍🏽 café ñ"]
    prompts = [tok.encode(t).ids for t in texts]
    seqs = [Seq(runner, p) for p in prompts]
    logits = runner.forward(make_batch(seqs, ForwardMode.EXTEND, [len(p) for p in prompts]))
    outs: list[list[int]] = [[] for _ in seqs]
    for _ in range(30):
        nxt = logits.argmax(-1).tolist()
        for s, o, t in zip(seqs, outs, nxt):
            s.ids.append(t)
            o.append(t)
        logits = runner.forward(make_batch(seqs, ForwardMode.DECODE, [1] * len(seqs)))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
        assert o == ref[0, len(p):].tolist()
    for s in seqs:
        runner.token_to_kv_pool.free(runner.req_to_token_pool.req_to_token[s.row, :s.cached])
        runner.req_to_token_pool.free(s.row)


VARIANTS: dict[str, dict[str, Any]] = {
    "llama3_rope_tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], head_dim=24),
    # Windows shorter than the prompts (90 and 7 tokens, the first in chunks of 60 and 30).
    "mistral_window": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16),
    "qwen2_window": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                         sliding_window=12, max_window_layers=1),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=32, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                       "factor": 8.0}}),
    "gemma3_softcap_tied": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=16,
                                sliding_window=12, layer_types=["full_attention", "sliding_attention"],
                                final_logit_softcapping=3.0, tie_word_embeddings=True),
    "qwen2_bias": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3_qknorm": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    "yarn": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64}),
}


WINDOWED = ["gemma3", "mistral_window", "qwen2_window"]


@pytest.mark.parametrize("name,cpu_kernels", [*((n, True) for n in sorted(VARIANTS)),
                                              *((n, False) for n in WINDOWED)],
                         ids=[*sorted(VARIANTS), *(f"{n}-plain-torch" for n in WINDOWED)])
def test_architecture_variants(name: str, cpu_kernels: bool, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(VARIANTS[name])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases and norms, so that a missing one changes the logits
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    # Plain torch decodes over the dense decode rows, or for Mistral without them (budget 0) from the
    # pool's gathered slots, as on CUDA.
    gather = not cpu_kernels and name == "mistral_window"
    r = ModelRunner(str(tmp_path), device="cpu", max_total_tokens=512, max_running_requests=4,
                    cpu_kernels=cpu_kernels, decode_cache_bytes=0 if gather else None)
    assert (r.attn_backend.native is not None) == (cpu_kernels and r.native is not None)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (90, 7)]  # 90 > yarn/llama3 original length
    seqs = [Seq(r, p) for p in prompts]
    r.forward(make_batch(seqs, ForwardMode.EXTEND, [60, 7]))
    logits = r.forward(make_batch(seqs[:1], ForwardMode.EXTEND, [30]))
    torch.testing.assert_close(logits[0], hf_last_logits(hf, prompts[0]), atol=ATOL, rtol=0)
    for s in seqs:
        s.ids.append(3)
    logits = r.forward(make_batch(seqs, ForwardMode.DECODE, [1, 1]))
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], hf_last_logits(hf, s.ids), atol=ATOL, rtol=0)


def test_decode_steps_run_on_decode_threads(runner: ModelRunner, model_dir: str) -> None:
    """--decode-threads: decode steps on fewer threads, prefill on all, the same logits either way."""
    threads0 = torch.get_num_threads()
    lean = ModelRunner(model_dir, device="cpu", max_total_tokens=1024, max_running_requests=4,
                       num_threads=2, decode_threads=1)
    try:
        assert (lean.prefill_threads, lean.decode_threads) == (2, 1)
        used: list[tuple[ForwardMode, int]] = []
        meta = lean.attn_backend.init_forward_metadata

        def spy(batch: ForwardBatch) -> None:
            used.append((batch.mode, torch.get_num_threads()))
            meta(batch)

        lean.attn_backend.init_forward_metadata = spy  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (33, 7)]
        pairs = [[Seq(r, p) for p in prompts] for r in (lean, runner)]
        logits = [r.forward(make_batch(s, ForwardMode.EXTEND, [33, 7])) for r, s in zip((lean, runner), pairs)]
        for _ in range(3):
            torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
            nxt = logits[1].argmax(-1).tolist()
            for seqs in pairs:
                for s, t in zip(seqs, nxt):
                    s.ids.append(t)
            logits = [r.forward(make_batch(s, ForwardMode.DECODE, [1, 1])) for r, s in zip((lean, runner), pairs)]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
        assert used == [(ForwardMode.EXTEND, 2)] + [(ForwardMode.DECODE, 1)] * 3
        for r, seqs in zip((lean, runner), pairs):
            for s in seqs:
                r.token_to_kv_pool.free(r.req_to_token_pool.req_to_token[s.row, :s.cached])
                r.req_to_token_pool.free(s.row)
    finally:
        torch.set_num_threads(threads0)


def test_a_backend_without_windows_is_refused_by_name_and_replaced_by_default(
        model_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A windowed model never runs on a backend that would ignore its windows (FlashInfer here, which
    needs CUDA; played by the Triton backend with its window support switched off)."""
    pytest.importorskip("triton")
    from services.scheduler.attention.triton_backend import TritonAttnBackend
    from services.scheduler.model_executor import model_runner
    from tests.random_models import build_windowed

    path = str(build_windowed("mistral", tmp_path / "mistral", model_dir))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend on CPU, as its own tests run it
    monkeypatch.setattr(TritonAttnBackend, "supports_sliding_window", False)
    with pytest.raises(ValueError, match="attention_backend: triton has no sliding-window attention"):
        ModelRunner(path, device="cpu", max_total_tokens=256, max_running_requests=2, attention_backend="triton")
    monkeypatch.setattr(model_runner, "resolve_attention_backend", lambda name, device: "triton")  # a CUDA default
    r = ModelRunner(path, device="cpu", max_total_tokens=256, max_running_requests=2)
    assert r.attention_backend == "torch" and r.attn_backend.distinct_windows == [16]


@pytest.mark.parametrize(("saved", "native", "want"), [
    ("float32", True, torch.float32), (None, True, torch.float32),          # float32 checkpoints stay exact
    ("bfloat16", True, torch.bfloat16), ("float16", True, torch.bfloat16),  # half precision: bf16 where native
    ("bfloat16", False, torch.float32),                                     # ... float32 where emulated
])
def test_auto_dtype_on_cpu_follows_the_checkpoint_and_the_cpu(monkeypatch: pytest.MonkeyPatch, saved: str | None,
                                                              native: bool, want: torch.dtype) -> None:
    from types import SimpleNamespace

    from services.scheduler.kernels import cpu_linear
    from services.scheduler.model_executor.model_runner import _resolve_dtype

    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)
    cfg = SimpleNamespace(dtype=None if saved is None else getattr(torch, saved))
    assert _resolve_dtype("auto", torch.device("cpu"), cfg) == want
    assert _resolve_dtype("auto", torch.device("cuda"), cfg) == torch.bfloat16
    assert _resolve_dtype("float32", torch.device("cpu"), cfg) == torch.float32


def test_bf16_on_cpu_is_bf16_linears_around_float32(model_dir: str) -> None:
    from services.scheduler.kernels import cpu_linear

    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    r = ModelRunner(model_dir, device="cpu", dtype="bfloat16", max_total_tokens=256, max_running_requests=4)
    assert (r.linear_dtype, r.dtype) == (torch.bfloat16, torch.float32)
    assert r.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16  # kv_cache_dtype auto follows the linears
    assert r.native is not None
    packed = [m for m in r.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert packed and all(m.weight.dtype == torch.bfloat16 for m in packed)
    assert r.dtype_label() == "bfloat16 linears and KV, float32 activations"


def test_bf16_edges_change_no_bit_of_the_logits(model_dir: str) -> None:
    """With bf16 linears the norms and the SiLU gate write their GEMM's bf16 input and gate_up, o_proj
    and down hand over their bf16 output: the same logits, bit for bit, as widening and rounding around
    every GEMM, in prefill (packed GEMMs), at 10 rows (packed) and at 2 (the native small-batch path)."""
    from services.scheduler.kernels import cpu_linear
    from services.scheduler.models.llama import LlamaMLP, RMSNorm

    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    # The Python layers both (the one-call decode stack takes the edges as they are at load).
    runners = [ModelRunner(model_dir, device="cpu", dtype="bfloat16", max_total_tokens=1024, max_running_requests=16,
                           disable_cuda_graph=True) for _ in range(2)]
    if runners[0].native is None:
        pytest.skip("no C compiler: the edges are the C kernels'")
    edged = [m for m in runners[0].model.modules() if isinstance(m, cpu_linear.PackedLinear) and m.out_bf16]
    layers = len(runners[0].model.layers)
    assert len(edged) == 3 * layers  # gate_up, o_proj and down of every layer
    # The norms know their linear's input dtype, not the linear: no module is registered twice.
    assert not [n for n, _ in runners[0].model.named_parameters() if "norm." in n and "_proj" in n]
    for m in runners[1].model.modules():  # the second converts around every GEMM, as before the edges
        if isinstance(m, cpu_linear.PackedLinear):
            m.out_bf16 = False
        if isinstance(m, RMSNorm):
            m.out_dtype = None
        if isinstance(m, LlamaMLP):
            m.down_dtype = None
    got: list[list[torch.Tensor]] = [[], []]
    for out, r in zip(got, runners):
        seqs = [Seq(r, [(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)]) for i in range(10)]
        out.append(r.forward(make_batch(seqs, ForwardMode.EXTEND, [len(s.ids) for s in seqs])))
        for step, rows in enumerate((10, 10, 2)):
            for s in seqs[:rows]:
                s.ids.append(int(out[-1][seqs.index(s)].argmax()) if step == 0 else 11 + step)
            out.append(r.forward(make_batch(seqs[:rows], ForwardMode.DECODE, [1] * rows)))
    for a, b in zip(*got):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_bf16_prefill_of_fresh_prompts_attends_in_bf16_and_agrees_with_the_c_kernel(model_dir: str) -> None:
    """Under bf16 linears an EXTEND whose requests have nothing cached runs flash attention in bf16 per
    request, or the C kernel's bf16 tile products where the CPU has AMX; one with a cached prefix keeps the
    C kernel. All compute causal attention over the same bf16 keys: they agree within bf16 rounding of the
    queries and weights."""
    from services.scheduler.kernels import cpu_linear

    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    r = ModelRunner(model_dir, device="cpu", dtype="bfloat16", max_total_tokens=512, max_running_requests=8)
    if r.native is None:
        pytest.skip("no C compiler: bf16 KV needs the C kernels")
    backend = r.attn_backend
    g = torch.Generator().manual_seed(0)
    on_tiles = backend.tiles
    for tiles in [False, True] if on_tiles else [False]:  # SDPA as on a CPU without AMX, then the tiles
        for lens in ([21], [9, 21]):
            backend.tiles = tiles
            seqs = [Seq(r, list(range(1, 1 + n))) for n in lens]
            backend.init_forward_metadata(make_batch(seqs, ForwardMode.EXTEND, lens))
            md = backend.metadata
            t = sum(lens)
            if tiles:
                assert md.prefill_spans is None  # the tile kernel
            else:
                assert md.prefill_spans == ([(0, 21)] if len(lens) == 1 else [(0, 9), (9, 30)])
            q = torch.randn(t, backend.num_heads, backend.head_dim, generator=g)
            k, v = (torch.randn(t, backend.num_kv_heads, backend.head_dim, generator=g) for _ in range(2))
            got = backend.forward(q, k, v, layer_id=0)  # writes the pool, then attends in bf16
            backend.tiles = False
            want = backend._extend_native(q, 0, md)     # the C kernel over the pool's bf16 keys, float32 math
            assert got.dtype == torch.float32 and got.shape == want.shape == (t, backend.num_heads * backend.head_dim)
            err = float((got - want).abs().max())
            assert 1e-6 < err < 0.05, (tiles, lens, err)  # bf16 queries and weights: close, not float32 itself
    backend.tiles = on_tiles
    # A prefill after a cached prefix reads the pool: the C kernel.
    seqs[0].ids += [100, 101, 102, 103]
    backend.init_forward_metadata(make_batch(seqs[:1], ForwardMode.EXTEND, [4]))
    assert backend.metadata.prefill_spans is None and backend.metadata.extend_layout is not None


def test_bf16_kv_cache_under_float32_activations(model_dir: str, hf_model) -> None:
    """--kv-cache-dtype bfloat16 with float32 weights: the pool (and the dense rows and prefix copies the
    C kernels read) hold bf16, so the prefill after a cached prefix and the decode steps read rounded
    keys; logits stay within bf16 rounding of transformers' float32 ones, and measurably off them."""
    r = ModelRunner(model_dir, device="cpu", kv_cache_dtype="bfloat16", max_total_tokens=1024, max_running_requests=4)
    if r.native is None:
        pytest.skip("no C compiler: bf16 KV needs the C kernels")
    assert (r.dtype, r.kv_dtype, r.token_to_kv_pool.k_buffer[0].dtype) == (torch.float32, torch.bfloat16,
                                                                           torch.bfloat16)
    assert r.dtype_label() == "float32 linears and activations, bfloat16 KV"
    assert r._kv_bytes_per_token() == r.token_to_kv_pool.bytes_per_token  # half the float32 pool's
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (17, 40)]
    seqs = [Seq(r, p) for p in prompts]
    errors = []
    logits = r.forward(make_batch(seqs, ForwardMode.EXTEND, [17, 30]))
    logits = r.forward(make_batch([seqs[1]], ForwardMode.EXTEND, [10]))  # reads 30 cached bf16 keys
    errors.append((logits[0] - hf_last_logits(hf_model, seqs[1].ids)).abs().max())
    next_ids = [int(hf_last_logits(hf_model, s.ids).argmax()) for s in seqs]
    for _ in range(4):
        for s, t in zip(seqs, next_ids):
            s.ids.append(t)
        logits = r.forward(make_batch(seqs, ForwardMode.DECODE, [1, 1]))
        errors += [(logits[i] - hf_last_logits(hf_model, s.ids)).abs().max() for i, s in enumerate(seqs)]
        next_ids = logits.argmax(-1).tolist()
    worst = float(max(errors))
    print(f"bf16 KV: largest logit error {worst:.2e}")
    assert 1e-5 < worst < BF16_KV_ATOL


@pytest.mark.parametrize(("asked", "cpu_kernels", "error"), [
    ("float8", True, "unknown kv_cache_dtype"), ("float16", True, "the CPU C kernels hold the KV cache"),
    ("bfloat16", False, "needs the CPU C kernels"), ("fp8_e4m3", False, "needs the CPU C kernels"),
])
def test_kv_cache_dtype_errors_name_the_flag(model_dir: str, asked: str, cpu_kernels: bool, error: str) -> None:
    with pytest.raises(ValueError, match=error) as e:
        ModelRunner(model_dir, device="cpu", kv_cache_dtype=asked, cpu_kernels=cpu_kernels, max_total_tokens=256,
                    max_running_requests=2)
    assert "kv_cache_dtype" in str(e.value)


def test_bf16_without_a_bf16_linear_runs_wholly_in_bf16(model_dir: str, hf_model,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bf16 linear (no AVX512-BF16 / AMX), --dtype bfloat16 is torch's bf16 throughout:
    weights, activations and KV, no C kernels; logits stay within bf16 rounding of float32's."""
    from services.scheduler.kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "supported", lambda dtype=torch.float32: dtype == torch.float32)
    r = ModelRunner(model_dir, device="cpu", dtype="bfloat16", max_total_tokens=256, max_running_requests=2)
    assert (r.linear_dtype, r.dtype, r.kv_dtype, r.native) == (torch.bfloat16, torch.bfloat16, torch.bfloat16, None)
    assert r.dtype_label() == "bfloat16"
    s = Seq(r, torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(3)).tolist())
    logits = r.forward(make_batch([s], ForwardMode.EXTEND, [20]))
    for _ in range(3):
        want = hf_last_logits(hf_model, s.ids)
        err = float((logits[0] - want).abs().max())
        print(f"bf16 logits error {err:.3g}")
        assert logits.dtype == torch.float32 and 1e-4 < err < 0.5  # measured 0.15
        s.ids.append(int(want.argmax()))
        logits = r.forward(make_batch([s], ForwardMode.DECODE, [1]))
