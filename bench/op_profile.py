"""Where a real step's time goes: the engine's decode steps at several batch sizes and one prefill, by op.

    python -m bench.op_profile [--model smollm2-135m-instruct] [--batches 1,32,64] [--context 384]
                               [--prefill 512] [--prefill-requests 1] [--steps 6] [--dtype auto] [--kv-cache-dtype auto]

Runs the scheduler's Engine in this process on the model (float32 on CPU unless --dtype or
--kv-cache-dtype say otherwise), brings
`b` requests of `context` prompt tokens into the running batch, then times `steps` decode steps
with a timer around each op family: the linears (by projection), attention (the backend, K/V store
included), rotary, the norms (with their residual adds), the embedding, sampling, the attention
metadata (the backend's per-step bookkeeping; on CPU the dense decode rows: the K/V of requests
joining the decode batch copied from the pool, once per request, so mostly in the first timed step,
the one the prefilled requests join, and the rows of requests that finished freed); "other in the
forward" is what the model does between them (activation, views, adds), "scheduling" the step
outside the forward and sampling. A timed call inside another is counted once, in the outer one.
The ops are timed on the Python layers; where the engine has the one-call native decode stack
(model_executor/cpu_decode.py), the same batch's step through it follows, as it is served.

Beside each linear row: the same matmuls as plain `F.linear` calls on fresh tensors (float32 and,
where the CPU has AVX512-BF16 or AMX, bfloat16), so the step can be read against the machine's GEMM
rate: "step / linears at the GEMM rate" says how far the step is from its matmuls alone. Below the
decode table, the memory floor: the bytes a step cannot avoid reading (every weight once, every request's
K and V over its context in every layer) at the rate a streaming read reaches in the same process, and
the served step against it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bench.model_info import resolve
from bench.venvs import log
from ringserve.model_source import DEFAULT_MODEL
from services.scheduler.kernels.cpu_linear import native_bf16

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class Timers:
    """Seconds per op family; only the outermost timed call of a nest counts."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    depth: int = 0

    def wrap(self, obj: Any, attr: str, family: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return inner(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[family] += time.perf_counter() - t0
                self.depth -= 1

        setattr(obj, attr, timed)  # an instance attribute: shadows the method (nn.Module.__call__ too)


def instrument(engine: Any) -> tuple[Timers, dict[str, float]]:
    """Timers around the model's op families, and a separate total for the forward and the step."""
    timers = Timers()
    runner, model = engine.runner, engine.runner.model
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in LINEARS:
            timers.wrap(m, "forward", f"linear {leaf}")
        elif type(m).__name__ == "RMSNorm":
            timers.wrap(m, "add_norm", "norms")
            timers.wrap(m, "forward", "norms")
    if model.lm_head is not None:
        timers.wrap(model.lm_head, "forward", "linear lm_head")
    timers.wrap(model.embed_tokens, "forward", "embedding")
    timers.wrap(runner.attn_backend, "forward", "attention")
    timers.wrap(runner.attn_backend, "init_forward_metadata", "attention metadata")
    timers.wrap(model.rotary, "apply", "rotary")
    timers.wrap(engine.scheduler, "sample", "sampling")
    totals: dict[str, float] = defaultdict(float)
    for obj, attr, key in ((runner, "forward", "forward"), (engine, "step", "step")):
        inner = getattr(obj, attr)

        def total(*args: Any, _inner: Callable[..., Any] = inner, _key: str = key, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                totals[_key] += time.perf_counter() - t0
        setattr(obj, attr, total)
    return timers, totals


def linear_shapes(model: torch.nn.Module) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every linear by family, one entry per layer (the lm_head: the embedding's when tied)."""
    shapes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in LINEARS:
            out_f, in_f = m.weight.shape
            shapes[f"linear {leaf}"].append((in_f, out_f))
    embed = model.get_submodule("embed_tokens")
    assert isinstance(embed, torch.nn.Embedding)
    vocab, hidden = embed.weight.shape
    shapes["linear lm_head"].append((hidden, vocab))
    return shapes


def read_rate(mib: int = 512, reps: int = 3) -> float:
    """Bytes per second a streaming read reaches on this process's threads: the best of `reps` sums over
    `mib` MiB of float32, more than the caches hold, so it is the memory's rate for this layout of work."""
    x = torch.ones(mib << 18)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def step_bytes(engine: Any, shapes: dict[str, list[tuple[int, int]]], batch: int, context: int) -> tuple[int, int]:
    """(weights, KV) bytes a decode step reads at the least: each linear's weight once (the lm_head's too)
    and, in every layer, each request's keys and values over its context."""
    from services.scheduler.kernels.cpu_linear import PackedLinear

    model = engine.runner.model
    linear = next((m for m in model.modules() if isinstance(m, PackedLinear | torch.nn.Linear)), None)
    elem = linear.weight.element_size() if linear is not None else 4
    weights = sum(i * o for family in shapes.values() for i, o in family) * elem
    attn = model.first_attention()
    kv_elem = engine.runner.token_to_kv_pool.k_buffer[0].element_size()
    kv = batch * context * len(model.layers) * 2 * attn.num_kv_heads * attn.head_dim * kv_elem
    return weights, kv


def gemm_seconds(rows: int, shape: tuple[int, int], dtype: torch.dtype, reps: int = 5) -> float:
    """Best of `reps` F.linear calls [rows, in] x [out, in]^T on fresh tensors (after one warm-up)."""
    x = torch.randn(rows, shape[0], dtype=dtype)
    w = torch.randn(shape[1], shape[0], dtype=dtype)
    F.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_table(shapes: dict[str, list[tuple[int, int]]], rows: dict[str, int],
               dtypes: list[torch.dtype]) -> dict[str, dict[torch.dtype, float]]:
    """Seconds per step of each linear family at the GEMM rate (one timing per distinct shape)."""
    cache: dict[tuple[int, tuple[int, int], torch.dtype], float] = {}
    out: dict[str, dict[torch.dtype, float]] = {}
    for family, family_shapes in shapes.items():
        out[family] = {}
        for dt in dtypes:
            total = 0.0
            for s in family_shapes:
                key = (rows[family], s, dt)
                if key not in cache:
                    cache[key] = gemm_seconds(rows[family], s, dt)
                total += cache[key]
            out[family][dt] = total
    return out


def report(title: str, timers: Timers, totals: dict[str, float], steps: int,
           gemm: dict[str, dict[torch.dtype, float]], dtypes: list[torch.dtype]) -> str:
    ms = {k: v / steps * 1e3 for k, v in timers.seconds.items()}
    fwd = totals["forward"] / steps * 1e3
    step = totals["step"] / steps * 1e3
    inside = sum(v for k, v in ms.items() if k != "sampling")
    ms["other in the forward"] = fwd - inside
    ms["scheduling"] = step - fwd - ms.get("sampling", 0.0)
    heads = " | ".join(f"F.linear {str(dt).removeprefix('torch.')} ms" for dt in dtypes)
    lines = [f"### {title}: {step:,.2f} ms per step ({fwd:,.2f} ms forward)", "",
             f"| op | ms per step | share | {heads} |", "|---|---|---|" + "---|" * len(dtypes)]
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        ref = " | ".join(f"{gemm[k][dt] * 1e3:,.2f}" if k in gemm else "" for dt in dtypes)
        lines.append(f"| {k} | {v:,.2f} | {v / step:.0%} | {ref} |")
    for dt in dtypes:
        alone = sum(g[dt] for g in gemm.values()) * 1e3
        lines.append(f"\nlinears alone at the {str(dt).removeprefix('torch.')} GEMM rate: {alone:,.2f} ms; "
                     f"step / that = {step / alone:.2f}x")
    return "\n".join(lines)


def fill(engine: Any, n: int, prompt_len: int, seed: int, new_tokens: int) -> tuple[list[str], int]:
    """Bring n requests of prompt_len random tokens into the running batch (their prefill done); returns
    their ids and the steps it took.

    Each asks for just the `new_tokens` the profile will run: the scheduler reserves KV for what a
    running request may still write, so an unbounded ask admits only a few requests at a time."""
    from services.scheduler.core.req import Req
    from services.scheduler.model_executor.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [Req(rid=f"profile-{seed}-{i}", origin_input_ids=[rng.randrange(256, vocab) for _ in range(prompt_len)],
                params=params, stream=True) for i in range(n)]
    for r in reqs:
        engine.submit(r)
    steps = 0
    while any(not r.output_ids for r in reqs):
        engine.step()
        steps += 1
    return [r.rid for r in reqs], steps


def drop(engine: Any, rids: list[str]) -> None:
    engine.abort(rids)
    while engine.scheduler.has_work():
        engine.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="tiny, 100m, smollm2-135m-instruct or a directory")
    ap.add_argument("--batches", default="1,32,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=384, help="tokens already in each request's context")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the profiled prefill (0: none)")
    ap.add_argument("--prefill-requests", type=int, default=1,
                    help="requests of --prefill tokens each in the profiled prefill (one step)")
    ap.add_argument("--steps", type=int, default=6, help="decode steps timed per batch size")
    ap.add_argument("--dtype", default="auto", help="the engine's --dtype")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    args = ap.parse_args(argv)

    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine
    from services.scheduler.memory import configure_malloc

    configure_malloc()  # as the scheduler service does

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    model_dir = resolve(args.model)
    # A pool that holds the largest batch whole: the CPU default (1 GiB of KV, ~23k tokens of this
    # model in float32) would hold 64 x 384 only in part, and the "batch 64" step would decode fewer.
    pool = max(batches + [1]) * (args.context + args.steps + 8) + args.prefill * args.prefill_requests + 64
    # Prefills back to back while filling (no decode steps between them): the first requests would
    # otherwise use up their few new tokens before the last one joins.
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype=args.dtype,
                                 kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=pool,
                                 max_running_requests=max(batches + [args.prefill_requests]), disable_radix_cache=True,
                                 disable_decode_interleave=True))
    engine.warmup()
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])
    shapes = linear_shapes(engine.runner.model)
    print(f"# Step profile: {model_dir.name}, {engine.runner.dtype_label()}, {torch.get_num_threads()} threads, "
          f"context {args.context}")
    timers, totals = instrument(engine)
    rate = read_rate()
    log(f"streaming read: {rate / 1e9:.1f} GB/s on {torch.get_num_threads()} threads")
    if args.prefill:
        n = args.prefill_requests
        log(f"prefill of {n} x {args.prefill} tokens, once untimed first (oneDNN builds its GEMMs for a new "
            f"row count on first use)")
        drop(engine, fill(engine, n, args.prefill, seed=1, new_tokens=2)[0])
        timers.seconds.clear()
        totals.clear()
        rids, steps = fill(engine, n, args.prefill, seed=0, new_tokens=2)
        if steps != 1:  # the table is per step: a split prefill would read as one slow one
            raise SystemExit(f"the profiled prefill took {steps} steps, not one: at most "
                             f"{engine.cfg.max_prefill_tokens} prompt tokens a step")
        rows = dict.fromkeys(shapes, n * args.prefill) | {"linear lm_head": n}
        print(report(f"prefill, {n} x {args.prefill} tokens", timers, totals, 1,
                     gemm_table(shapes, rows, dtypes), dtypes) + "\n", flush=True)
        drop(engine, rids)
    for b in batches:
        log(f"decode at batch {b}: prefilling {b} x {args.context} tokens first")
        rids, _ = fill(engine, b, args.context, seed=b, new_tokens=2 * args.steps + 3)
        # One untimed step first: in it every request joins decode at once and the CPU backend copies
        # its whole prefix into a dense row, a cost that serving spreads over requests' arrivals.
        t0 = time.perf_counter()
        engine.step()
        joined_ms = (time.perf_counter() - t0) * 1e3
        log(f"decode at batch {b}: the step the {b} requests joined in took {joined_ms:,.0f} ms; "
            f"timing the next {args.steps}")
        # The ops one by one need the Python layers: the one-call stack (as served) is timed after them.
        stack, engine.runner.decode_stack = engine.runner.decode_stack, None
        timers.seconds.clear()
        totals.clear()
        decoding = []
        for _ in range(args.steps):
            decoding.append(len(engine.scheduler.running))
            engine.step()
        if min(decoding) != b:
            log(f"decode at batch {b}: only {min(decoding)}-{max(decoding)} requests decoded per step")
        gemm = gemm_table(shapes, dict.fromkeys(shapes, b), dtypes)
        text = report(f"decode, batch {b}", timers, totals, args.steps, gemm, dtypes)
        step_ms = totals["step"] / args.steps * 1e3
        if stack is not None:
            engine.runner.decode_stack = stack
            totals.clear()
            for _ in range(args.steps):
                engine.step()
            step_ms = totals["step"] / args.steps * 1e3
            best = dtypes[-1]  # bf16 where the CPU computes it
            alone = sum(g[best] for g in gemm.values()) * 1e3
            text += (f"\nthe same step with the one-call native decode stack (as served): {step_ms:,.2f} ms; / the "
                     f"linears alone at the {str(best).removeprefix('torch.')} GEMM rate = {step_ms / alone:.2f}x")
        weights, kv = step_bytes(engine, shapes, b, args.context + 1 + args.steps // 2)  # the mean context timed
        floor_ms = (weights + kv) / rate * 1e3
        text += (f"\nmemory floor: {weights / 1e6:,.0f} MB of weights + {kv / 1e6:,.0f} MB of KV a step at the "
                 f"streaming read rate ({rate / 1e9:.1f} GB/s) = {floor_ms:,.2f} ms; step as served / that = "
                 f"{step_ms / floor_ms:.2f}x")
        print(text + "\n", flush=True)
        drop(engine, rids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
