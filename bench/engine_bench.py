"""In-process throughput: this engine vs transformers on the same weights.

    python -m bench.engine_bench [--shape tiny,100m] [--concurrency 1,8,32,64] [--output-len 64]
                                 [--[no-]disable-overlap-schedule]

For each concurrency c (c requests submitted at once, random prompts, fixed output length, greedy,
EOS ignored) it measures output tokens per second of:
- engine:  this engine (`Engine.generate`), continuous batching over the KV pool;
- hf-seq:  transformers `generate`, one request at a time (a few requests: its rate does not depend on c);
- hf-static: one static left-padded batch of c requests through `generate`;
- hf-cb:   transformers continuous batching (`generate_batch`).
Small defaults so a run ends in a few minutes on 2 cores.

    python -m bench.engine_bench --moe [--moe-layers 2] [--concurrency 1,64]

instead times one decode step of a mixture-of-experts model: a random Qwen3-MoE with the layer shape
of Qwen3-30B-A3B (hidden 2048, 128 experts of width 768, top-8, 32 query / 4 KV heads of 128) and a
32k vocabulary, a few layers (float32: about 2.5 GB per layer). Per batch size c it reports ms per
decode step of this engine (forward, sampling and bookkeeping, from its step counters) and of
transformers' own forward (one token per row over a DynamicCache, its default experts kernel), each
after a prompt of --moe-context tokens per row. The two run one after the other, never both in memory.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ringserve.default_model import DEFAULT_MODEL_DIR, SHAPES, build

HF_SEQ_MAX_REQUESTS = 4


def model_dir(shape: str) -> str:
    out = DEFAULT_MODEL_DIR if shape == "tiny" else DEFAULT_MODEL_DIR.with_name(f"ringserve-{shape}-llama")
    return str(build(out, SHAPES[shape]))


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def run_engine(engine, prompts: list[list[int]], out_len: int) -> int:
    from services.scheduler.model_executor.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True)
    return sum(len(r.output_ids) for r in engine.generate(prompts, params))


@torch.inference_mode()
def run_hf_seq(hf, prompts: list[list[int]], out_len: int) -> int:
    total = 0
    for p in prompts[:HF_SEQ_MAX_REQUESTS]:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=out_len,
                          min_new_tokens=out_len, pad_token_id=0)
        total += out.shape[1] - ids.shape[1]
    return total


@torch.inference_mode()
def run_hf_static(hf, prompts: list[list[int]], out_len: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                      min_new_tokens=out_len, pad_token_id=0)
    return (out.shape[1] - width) * len(prompts)


@torch.inference_mode()
def run_hf_cb(hf, prompts: list[list[int]], out_len: int) -> int:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=out_len, eos_token_id=None, pad_token_id=0)
    results = hf.generate_batch(prompts, generation_config=cfg, progress_bar=False, **_hf_cb_cache(prompts, out_len))
    return sum(len(r.generated_tokens) for r in results.values())


def _hf_cb_cache(prompts: list[list[int]], out_len: int) -> dict:
    """A paged cache sized to the workload, as the engine's is. Left to itself, generate_batch sizes it
    from free memory (on CPU: most of the machine's RAM) and builds it again on every call: 7-19 s
    for one request of 64 tokens here, against 0.7 s sized."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers: its own sizing
        return {}
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(p) + out_len) // page) for p in prompts)
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=2048)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", help=f"comma list of {','.join(sorted(SHAPES))}: one table each")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-len", default="32,128", help="min,max prompt tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma list of runs to skip: hf-seq,hf-static,hf-cb")
    ap.add_argument("--disable-overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine without (--no-: with) overlap scheduling (core/overlap.py); default: "
                         "the engine's (off on CPU)")
    ap.add_argument("--moe", action="store_true", help="time an MoE decode step instead (see above)")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--moe-context", type=int, default=64, help="prompt tokens per row before the timed steps")
    ap.add_argument("--moe-steps", type=int, default=16, help="decode steps timed per batch size")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.moe:
        bench_moe_decode(args)
        return 0
    shapes = [x for x in args.shape.split(",") if x]
    bad = [x for x in shapes if x not in SHAPES]
    if bad:
        ap.error(f"--shape: unknown {bad}; choose from {sorted(SHAPES)}")
    for shape in shapes:
        bench_shape(shape, args)
    return 0


def bench_shape(shape: str, args: argparse.Namespace) -> None:
    """The engine and each transformers mode at every concurrency on one model; prints a table."""
    conc = [int(c) for c in args.concurrency.split(",")]
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    skip = set(filter(None, args.skip.split(",")))
    path = model_dir(shape)

    from transformers import AutoModelForCausalLM

    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine

    engine = Engine(EngineConfig(model=path, device="cpu", max_running_requests=max(conc),
                                 max_total_tokens=max(conc) * (hi + args.output_len + 8),
                                 num_threads=args.num_threads,
                                 disable_overlap_schedule=args.disable_overlap_schedule))
    engine.warmup()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = engine.runner.vocab_size
    runs = {"engine": lambda p: run_engine(engine, p, args.output_len),
            "hf-seq": lambda p: run_hf_seq(hf, p, args.output_len),
            "hf-static": lambda p: run_hf_static(hf, p, args.output_len),
            "hf-cb": lambda p: run_hf_cb(hf, p, args.output_len)}
    print(f"model {shape} ({path}), threads {torch.get_num_threads()}, prompts {lo}-{hi} tokens, "
          f"output {args.output_len} tokens, overlap schedule {'off' if engine.overlap is None else 'on'}",
          flush=True)
    rows: list[tuple[int, dict[str, float]]] = []
    for c in conc:
        prompts = make_prompts(c, lo, hi, vocab, seed=c)
        rates: dict[str, float] = {}
        for name, fn in runs.items():
            if name in skip:
                continue
            try:
                secs, toks = timed(lambda: fn(prompts))  # noqa: B023 - called at once, inside the loop
            except Exception as e:  # an API drift in transformers must not lose the other numbers
                print(f"  c={c:<3} {name:<9} failed: {type(e).__name__}: {e}", flush=True)
                continue
            rates[name] = toks / secs
            print(f"  c={c:<3} {name:<9} {toks:6d} tokens in {secs:6.2f}s = {rates[name]:8.1f} tok/s", flush=True)
        rows.append((c, rates))

    names = list(runs)
    print("\noutput tok/s" + "".join(f"{n:>12}" for n in names) + "".join(f"{'x ' + n:>14}" for n in names[1:]))
    for c, rates in rows:
        cells = "".join(f"{rates[n]:12.1f}" if n in rates else f"{'-':>12}" for n in names)
        ratios = "".join(f"{rates['engine'] / rates[n]:14.2f}" if n in rates and "engine" in rates
                         else f"{'-':>14}" for n in names[1:])
        print(f"c={c:<10}" + cells + ratios)


# Qwen3-30B-A3B's layer (its config.json), with a 32k vocabulary: the MoE step, not the LM head, is measured.
MOE_SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=False)


def bench_moe_decode(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    conc = [int(c) for c in args.concurrency.split(",")]
    cfg = AutoConfig.for_model("qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                               num_hidden_layers=args.moe_layers, **MOE_SHAPE)
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    try:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        hf.save_pretrained(tmp)
        tokenizer = Path(model_dir("tiny"))  # the engine loads a tokenizer; the prompts are ids
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tokenizer / f, tmp / f)
        impl = getattr(hf.config, "_experts_implementation", None) or "default"
        print(f"MoE decode step: Qwen3-30B-A3B layer shape, {args.moe_layers} layers, float32, "
              f"threads {torch.get_num_threads()}, context {args.moe_context} tokens per row", flush=True)
        hf_ms = {c: hf_decode_ms(hf, c, args.moe_context, args.moe_steps) for c in conc}
        del hf
        ours = engine_decode_ms(str(tmp), conc, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'batch':>6}{'engine ms/step':>16}{'hf forward ms':>16}{'x hf':>8}   (hf experts: {impl})")
    for c in conc:
        print(f"{c:>6}{ours[c]:16.1f}{hf_ms[c]:16.1f}{hf_ms[c] / ours[c]:8.2f}")


@torch.inference_mode()
def hf_decode_ms(hf, batch: int, context: int, steps: int) -> float:
    """ms per transformers forward of one token per row, after a `context`-token prompt in its cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, hf.config.vocab_size, (batch, context), generator=g)
    cache = DynamicCache(config=hf.config)
    out = hf(ids, cache=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    hf(nxt, cache=cache, use_cache=True)  # one untimed step: first-call costs
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    ms = (time.perf_counter() - t0) / steps * 1000
    print(f"  hf     c={batch:<3} {ms:8.1f} ms/step", flush=True)
    return ms


def engine_decode_ms(path: str, conc: list[int], args: argparse.Namespace) -> dict[int, float]:
    """ms per decode step of this engine (its step counters), `steps` tokens after a `context` prompt."""
    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine
    from services.scheduler.model_executor.sampling import SamplingParams

    engine = Engine(EngineConfig(model=path, device="cpu", max_running_requests=max(conc),
                                 max_total_tokens=max(conc) * (args.moe_context + args.moe_steps + 8),
                                 num_threads=args.num_threads))
    engine.warmup()
    out = {}
    for c in conc:
        prompts = make_prompts(c, args.moe_context, args.moe_context, engine.runner.vocab_size, seed=c)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.moe_steps + 1, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        stats = engine.scheduler.stats
        steps0, secs0 = stats.decode_steps, stats.decode_s
        engine.generate(prompts, params)
        out[c] = (stats.decode_s - secs0) / (stats.decode_steps - steps0) * 1000
        print(f"  engine c={c:<3} {out[c]:8.1f} ms/step", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
