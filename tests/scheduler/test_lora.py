"""LoRA in the scheduler, in process: adapter checks, the per-forward plan, the slot pool under
--max-loras-per-batch, per-adapter prefix-cache namespaces, and unload while in use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ringserve.errors import FailedPrecondition, InvalidArgument, NotFound
from ringserve.message import LoraAdapter, SamplingParams
from services.scheduler.config import EngineConfig
from services.scheduler.core import control
from services.scheduler.core.engine import Engine
from services.scheduler.core.req import Req
from services.scheduler.lora.adapter import expand_targets, parse_lora_paths
from services.scheduler.lora.layers import plan_rows

# The tiny model (ringserve.default_model): hidden 256, 8 q heads and 4 kv heads of 32, intermediate 512.
DIMS = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
        "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, min_new_tokens=6)


def write_adapter(out: Path, seed: int, r: int = 4, targets: tuple[str, ...] = tuple(DIMS), layers: int = 4,
                  config: dict | None = None) -> str:
    """A random adapter in PEFT's file layout, without peft (the e2e tests use peft itself)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m in targets:
            d_in, d_out = DIMS[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), **(config or {})}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": write_adapter(root / "a", 1), "b": write_adapter(root / "b", 2, r=2, targets=("q_proj", "v_proj")),
            "c": write_adapter(root / "c", 3, targets=("down_proj", "gate_proj"))}


@pytest.fixture(scope="module")
def engine(model_dir: str, adapters: dict[str, str]) -> Engine:
    # Two slots for three adapters: batches are limited, and slots are refilled as adapters rotate;
    # mixed steps and 8-token chunks put prefill and decode rows of several adapters in one forward.
    return Engine(EngineConfig(model=model_dir, lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
                               max_loras_per_batch=2, max_lora_rank=4, max_total_tokens=2048,
                               max_running_requests=16, grammar_backend="none", enable_mixed_chunk=True,
                               chunked_prefill_size=8))


def test_flags() -> None:
    assert parse_lora_paths(["x=/a", "/b"]) == [("x", "/a"), ("/b", "/b")]
    with pytest.raises(ValueError, match="twice"):
        parse_lora_paths(["x=/a", "x=/b"])
    assert expand_targets(["qkv_proj", "down_proj"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    with pytest.raises(ValueError, match="lm_head"):
        expand_targets(["lm_head"])


def test_plan_groups_rows_by_slot() -> None:
    assert plan_rows([-1, -1], [3, 1], torch.device("cpu")) is None
    plan = plan_rows([0, 0, -1, 1, 0], [2, 3, 1, 1, 1], torch.device("cpu"))
    assert plan is not None
    groups = dict(plan.groups)
    assert isinstance(groups[1], slice) and (groups[1].start, groups[1].stop) == (6, 7)
    # Slot 0: two ranges (the first two requests' merged into one).
    assert isinstance(groups[0], torch.Tensor) and groups[0].tolist() == [0, 1, 2, 3, 4, 7]


def test_mixed_batches_equal_alone_with_fewer_slots_than_adapters(engine: Engine) -> None:
    prompts = [[11, 12], [5, 17, 300, 42, 9] * 3]  # the short ones decode while the long ones prefill
    names = ["", "a", "b", "c"]
    alone = {(i, n): engine.generate([p], GREEDY, lora=[n])[0].output_ids for i, p in enumerate(prompts) for n in names}
    for i in range(len(prompts)):
        assert len({tuple(alone[(i, n)]) for n in names}) == 4  # every adapter changes the output
    cases = [(i, n) for i in range(len(prompts)) for n in names]
    assert engine.flush_cache()[0]  # no cached prompts: the long ones prefill in chunks, mixed with decodes
    together = engine.generate([prompts[i] for i, _ in cases], GREEDY, lora=[n for _, n in cases])
    assert [r.output_ids for r in together] == [alone[c] for c in cases]
    assert engine.scheduler.stats.mixed_steps > 0
    engine.tree.check()


def test_prefix_cache_never_crosses_adapters(engine: Engine) -> None:
    prompt = list(range(100, 140))
    engine.generate([prompt], GREEDY)
    base = engine.generate([prompt], GREEDY)[0]
    on_a = engine.generate([prompt], GREEDY, lora=["a"])[0]
    assert base.cached_tokens > 30 and on_a.cached_tokens == 0
    assert engine.generate([prompt], GREEDY, lora=["a"])[0].cached_tokens > 30


def test_unknown_adapter_is_not_found(engine: Engine) -> None:
    with pytest.raises(NotFound, match="'nope'"):
        engine.submit(Req(rid="x", origin_input_ids=[1, 2], params=GREEDY, lora_name="nope"))


def test_unload_refused_while_in_use_then_frees_its_cache(engine: Engine, tmp_path: Path) -> None:
    control.load_lora(engine, LoraAdapter("d", write_adapter(tmp_path / "d", 4)))
    prompt = list(range(200, 230))
    engine.generate([prompt], GREEDY, lora=["d"])  # its KV now cached under d
    used_before = engine.kv.kv_pool.available_size()
    engine.submit(Req(rid="d-run", origin_input_ids=prompt, params=GREEDY, lora_name="d"))
    with pytest.raises(FailedPrecondition, match="in use by 1"):
        control.unload_lora(engine, "d")
    while engine.has_work():
        engine.step()
    control.unload_lora(engine, "d")
    assert engine.kv.kv_pool.available_size() > used_before  # its cached prefix went back to the pool
    engine.tree.check()
    with pytest.raises(NotFound):
        control.unload_lora(engine, "d")


def test_bad_adapters_name_the_problem(engine: Engine, tmp_path: Path) -> None:
    cases = [
        (tmp_path / "none", "adapter_config.json"),
        (Path(write_adapter(tmp_path / "dora", 5, config={"use_dora": True})), "use_dora"),
        (Path(write_adapter(tmp_path / "big", 6, r=8)), "above --max-lora-rank 4"),
        (Path(write_adapter(tmp_path / "deep", 7, layers=5)), "layer 4"),
    ]
    for path, problem in cases:
        with pytest.raises(InvalidArgument, match="lora_path") as e:
            control.load_lora(engine, LoraAdapter("bad", str(path)))
        assert problem in str(e.value), (path, e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_equals_cpu(model_dir: str, adapters: dict[str, str], engine: Engine) -> None:
    """The same plain-torch LoRA path on CUDA (float32, so greedy ids compare exactly; CUDA graphs on
    for the base-only decode steps) gives the CPU engine's tokens for a mixed batch."""
    gpu = Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32",
                              lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()), max_loras_per_batch=2,
                              max_lora_rank=4, max_total_tokens=2048, grammar_backend="none"))
    prompts, names = [[5, 17, 300, 42, 9], [11, 12], [7, 7, 7]] * 2, ["", "a", "b", "c", "a", ""]
    want = [r.output_ids for r in engine.generate(prompts, GREEDY, lora=names)]
    assert [r.output_ids for r in gpu.generate(prompts, GREEDY, lora=names)] == want


def test_bf16_linears_take_adapters(model_dir: str, adapters: dict[str, str]) -> None:
    """With bf16 linears on CPU the hooks wrap the packed bf16 layers: every adapter changes the output,
    and a batch mixing adapters gives each request what it gets alone."""
    from services.scheduler.kernels import cpu_linear

    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    e = Engine(EngineConfig(model=model_dir, dtype="bfloat16", lora_paths=(f"a={adapters['a']}", f"c={adapters['c']}"),
                            max_loras_per_batch=2, max_lora_rank=4, max_total_tokens=1024, max_running_requests=8,
                            grammar_backend="none"))
    assert e.runner.linear_dtype == torch.bfloat16
    prompt = [5, 17, 300, 42, 9] * 3
    alone = {n: e.generate([prompt], GREEDY, lora=[n])[0].output_ids for n in ("", "a", "c")}
    assert len({tuple(ids) for ids in alone.values()}) == 3
    together = e.generate([prompt] * 3, GREEDY, lora=["", "a", "c"])
    assert [r.output_ids for r in together] == [alone[n] for n in ("", "a", "c")]
