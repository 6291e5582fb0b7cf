"""Every registered architecture against transformers: greedy tokens through the Engine (concurrent
requests, 16-token prefill chunks) equal `generate`'s, on a small random checkpoint of each; and the
MoE block's routing and loading on their own."""

from __future__ import annotations

import pytest
import torch

from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.model_executor.sampling import SamplingParams
from services.scheduler.models import ARCHITECTURES
from tests.random_models import CONFIGS, build

NEW = 8
TEXTS = ["Once upon a time", "你好，世界！今天天气很好", "The quick brown fox jumps over the lazy dog. " * 3, "a"]
# Qwen3-MoE and Phi-3 run the same check through the four processes (tests/e2e/test_model_families.py).
IN_PROCESS = ["MixtralForCausalLM", "Qwen2MoeForCausalLM"]


def test_every_registered_architecture_has_a_test_config() -> None:
    # Greedy parity: the dense four in test_model_runner's variants and the tiny model's e2e tests;
    # Mixtral and Qwen2-MoE here; Qwen3-MoE and Phi-3 through the four processes.
    assert set(CONFIGS) == set(ARCHITECTURES)


def hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", IN_PROCESS)
def test_greedy_equals_transformers_concurrent_and_chunked(arch: str, model_dir: str, tmp_path) -> None:
    path = str(build(arch, tmp_path / arch, model_dir))
    tok = TextTokenizer.from_model(path)
    prompts = [tok.encode(t) for t in TEXTS]
    engine = Engine(EngineConfig(model=path, device="cpu", max_total_tokens=2048, max_running_requests=8,
                                 chunked_prefill_size=16))
    assert type(engine.runner.model).__name__ == arch
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)
    got = [r.output_ids for r in engine.generate(prompts, params)]
    assert engine.scheduler.stats.prefill_steps > 1  # the long prompt went in chunks
    assert got == hf_greedy(path, prompts)


def naive_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped computation must equal."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for w, e in zip(routing.weights[t].tolist(), routing.ids[t].tolist()):
            gu = gate_up[e] @ x[t]
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("native", [False, True], ids=["torch", "c-kernel"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_the_per_token_definition(renormalize: bool, tokens: int, native: bool) -> None:
    """64 tokens x top-2 over 8 experts: some experts above SMALL_ROWS (BLAS), some below (C kernel)."""
    from services.scheduler.kernels.cpu_kernels import load
    from services.scheduler.models.moe import SMALL_ROWS, GroupedExperts, route

    g = torch.Generator().manual_seed(tokens)
    experts = GroupedExperts(num_experts=8, hidden=32, inter=16)
    if native:
        experts.native = load(None)
        if experts.native is None:
            pytest.skip("no C compiler: the native kernels are off")
    experts.gate_up_proj.data = torch.randn(8, 32, 32, generator=g) * 0.2
    experts.down_proj.data = torch.randn(8, 32, 16, generator=g) * 0.2
    x = torch.randn(tokens, 32, generator=g)
    routing = route(torch.randn(tokens, 8, generator=g), top_k=2, renormalize=renormalize, dtype=x.dtype)
    assert torch.allclose(routing.weights.sum(-1), torch.ones(tokens)) == renormalize
    assert routing.ids.unique().numel() <= 2 * tokens  # at batch 1 only two experts are read
    counts = torch.bincount(routing.ids.reshape(-1), minlength=8)
    assert tokens < 64 or (counts.max() > SMALL_ROWS and counts[counts > 0].min() <= SMALL_ROWS)
    want = naive_moe(x, experts.gate_up_proj, experts.down_proj, routing)
    torch.testing.assert_close(experts(x, routing), want, atol=1e-5, rtol=1e-5)


def test_stacked_expert_checkpoint_loads_as_per_expert_one(model_dir: str, tmp_path) -> None:
    """transformers 5 holds experts stacked ([E, 2I, H], [E, H, I]) in memory; a checkpoint written
    from its state_dict has them so, where save_pretrained writes one tensor per expert."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from services.scheduler.model_executor.model_runner import ModelRunner

    per_expert = build("Qwen3MoeForCausalLM", tmp_path / "a", model_dir)
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    stacked = tmp_path / "b"
    stacked.mkdir()
    for f in per_expert.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    a, b = (ModelRunner(str(p), device="cpu", max_total_tokens=64, max_running_requests=2).model
            for p in (per_expert, stacked))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_a_missing_expert_is_named(model_dir: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from services.scheduler.model_executor.model_runner import ModelRunner

    path = build("MixtralForCausalLM", tmp_path / "m", model_dir)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"layers\.2\.mlp\.experts\.gate_up_proj#11"):  # expert 5's up half
        ModelRunner(str(path), device="cpu", max_total_tokens=64, max_running_requests=2)


def test_longrope_short_below_the_original_length_long_from_it() -> None:
    """Against transformers' Phi-3 rotary: the short factors where it uses them (a sequence within the
    original length), the long ones for positions past it (where it uses them for the whole sequence)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from services.scheduler.models.rotary import RotaryEmbedding
    from tests.random_models import hf_config

    cfg = hf_config("Phi3ForCausalLM")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ours = RotaryEmbedding(cfg, head_dim, 512, torch.device("cpu"), torch.float32)
    hf = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, dtype=torch.float32)
    short_cos, short_sin = hf(x, torch.arange(256)[None])   # max position 255 < 256: short factors
    long_cos, long_sin = hf(x, torch.arange(512)[None])     # longer: long factors throughout
    half = ours.rot_dim // 2
    torch.testing.assert_close(ours.cos[:256], short_cos[0, :, :half])
    torch.testing.assert_close(ours.sin[:256], short_sin[0, :, :half])
    torch.testing.assert_close(ours.cos[256:], long_cos[0, 256:, :half])
    torch.testing.assert_close(ours.sin[256:], long_sin[0, 256:, :half])
    assert not torch.allclose(ours.cos[100], long_cos[0, 100, :half])  # the two factor sets really differ
