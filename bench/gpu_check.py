"""One device check on one GPU (an H200 in mind), in under 8 minutes by construction, nothing fetched.

    python -m bench.gpu_check            # make gpu-check
    python -m bench.gpu_check --cpu-smoke  # every leg on CPU with tiny shapes (tests/bench/test_gpu_check.py)

Legs, each with a time budget; a leg whose budget no longer fits before the overall deadline is
skipped with a line, and a watchdog prints the report so far and exits at the deadline whatever a
leg is doing (a hung leg included). So the run ends by DEADLINE_S (450 s) + the report: < 8 min.
1. models: random-weight models of SmolLM2-135M's and Llama-3.2-1B's shapes, built here from configs
   (transformers, bf16, on the device) with the repo's own tiny tokenizer (ids < 4096 fit both vocabs).
2. parity: per model, per attention backend (triton, torch, flashinfer if it imports), CUDA graphs
   on and off: greedy decode through ModelRunner, teacher-forced against transformers on the same
   weights (bf16, same device). Tolerance: top-1 agreement >= TOP1_MIN on positions where the
   reference's top-2 margin exceeds MARGIN, and max |logprob error| of the reference's top-1 token
   <= LOGPROB_TOL (bf16 through 16-30 layers; the CPU fp32 path is held to 1e-4 in tests).
3. overlap: Engine.generate greedy with overlap on and off through EngineConfig's
   disable_overlap_schedule (skipped with a line when that field does not exist); outputs must match.
4. decode: tok/s at batch 1, 64 and 256 (triton, graphs on) as a fraction of the HBM-bandwidth bound
   (weights + the batch's KV read once per step at HBM_BYTES_S).
5. gateway: the four services (launcher) on the 135M shape; output tok/s of concurrent /generate calls.
What the device machine must be handed: this working tree (no .cache) and the wheels the services
import beyond torch/triton/transformers (requirements.txt: grpcio, protobuf, fastapi, uvicorn, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEADLINE_S = 450.0
TOP1_MIN = 0.97
MARGIN = 0.1
LOGPROB_TOL = 0.25
HBM_BYTES_S = 4.8e12  # H200 HBM3e peak

SHAPES: dict[str, dict[str, Any]] = {  # Hugging Face llama configs of the two models (weights random)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
                "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                               max_position_embeddings=512),
                "tiny-b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=1, vocab_size=4096, tie_word_embeddings=False,
                               max_position_embeddings=512)}


@dataclasses.dataclass
class Plan:
    device: str
    dtype: str
    shapes: dict[str, dict[str, Any]]
    prompt_lens: tuple[int, ...]
    gen_steps: int
    batch_sizes: tuple[int, ...]
    decode_steps: int
    decode_prompt: int
    gateway_requests: int
    gateway_tokens: int
    budgets: dict[str, float]  # seconds a leg needs at most (per model for per-model legs)
    backends: tuple[str, ...] = ("triton", "torch", "flashinfer")


GPU = Plan("cuda", "bfloat16", SHAPES, (5, 37, 200, 700), 24, (1, 64, 256), 32, 512, 128, 128,
           dict(models=60, parity=90, overlap=30, decode=45, gateway=120))
SMOKE = Plan("cpu", "float32", SMOKE_SHAPES, (5, 20, 70), 4, (1, 4), 3, 16, 4, 8,
             dict(models=20, parity=60, overlap=20, decode=20, gateway=90))


class Report:
    def __init__(self, deadline: float) -> None:
        self.lines: list[str] = []
        self.deadline = deadline
        self.lock = threading.Lock()
        self.printed = False

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)
        print(f"# {line}", file=sys.stderr, flush=True)  # progress as it goes; the report is at the end

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, leg: str, need: float) -> bool:
        if self.left() < need:
            self.add(f"SKIP {leg}: needs ~{need:.0f}s, {max(self.left(), 0):.0f}s left before the deadline")
            return False
        return True

    def print(self) -> None:
        with self.lock:
            if self.printed:
                return
            self.printed = True
            print("==== gpu_check report ====")
            print("\n".join(self.lines), flush=True)


def build_models(plan: Plan, out: Path, rep: Report) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ringserve.default_model import DEFAULT_MODEL_DIR, build

    tok_dir = build(DEFAULT_MODEL_DIR)  # the repo's tiny tokenizer: built locally, nothing fetched
    eos = json.loads((tok_dir / "config.json").read_text()).get("eos_token_id")
    paths = {}
    for name, shape in plan.shapes.items():
        t0 = time.monotonic()
        path = out / name
        path.mkdir(parents=True)
        for f in tok_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, path / f.name)
        cfg = LlamaConfig(**shape, eos_token_id=eos, bos_token_id=1)
        torch.manual_seed(0)
        with torch.device(plan.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, plan.dtype))
        model.save_pretrained(path)
        del model
        paths[name] = path
        rep.add(f"model {name}: built in {time.monotonic() - t0:.1f}s ({shape['num_hidden_layers']} layers, "
                f"hidden {shape['hidden_size']})")
    return paths


def prompts(plan: Plan) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 4000, (n,), generator=g).tolist() for n in plan.prompt_lens]


def engine_greedy(runner: Any, ps: list[list[int]], steps: int,
                  timing: list[float] | None = None) -> tuple[list[list[int]], list[Any]]:
    """Prefill all prompts, then `steps` greedy decode steps; each request's tokens and per-step
    log-softmax rows [steps + 1, V] (CPU float32). `timing` gets the decode steps' seconds."""
    import torch

    from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode

    dev = runner.device
    rows = [runner.req_to_token_pool.alloc() for _ in ps]
    ids = [list(p) for p in ps]
    cached = [0] * len(ps)
    lps: list[list[torch.Tensor]] = [[] for _ in ps]

    def step(mode: ForwardMode, new: list[int]) -> torch.Tensor:
        locs: list[torch.Tensor] = []
        toks: list[int] = []
        pos: list[int] = []
        for i, n in enumerate(new):
            slots = runner.token_to_kv_pool.alloc(n)
            runner.req_to_token_pool.req_to_token[rows[i], cached[i]:cached[i] + n] = slots
            locs.append(slots)
            toks += ids[i][cached[i]:cached[i] + n]
            pos += range(cached[i], cached[i] + n)
        prefix = list(cached)
        for i, n in enumerate(new):
            cached[i] += n
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        return runner.forward(ForwardBatch(mode, t(toks), t(pos), torch.cat(locs), t(rows), t(cached), list(new),
                                           prefix, list(cached)))

    logits = step(ForwardMode.EXTEND, [len(p) for p in ps])
    _sync(dev)
    t0 = time.monotonic()
    for _ in range(steps + 1):
        lp = logits.float().log_softmax(-1).cpu()
        for i in range(len(ps)):
            lps[i].append(lp[i])
            ids[i].append(int(lp[i].argmax()))
        if len(lps[0]) > steps:
            break
        logits = step(ForwardMode.DECODE, [1] * len(ps))
    _sync(dev)
    if timing is not None:
        timing.append(time.monotonic() - t0)
    for i, r in enumerate(rows):
        runner.token_to_kv_pool.free(runner.req_to_token_pool.req_to_token[r, :cached[i]])
        runner.req_to_token_pool.free(r)
    return [x[len(p):] for x, p in zip(ids, ps)], [torch.stack(x) for x in lps]


def compare(hf: Any, ps: list[list[int]], outs: list[list[int]], lps: list[Any], device: str) -> tuple[float, float]:
    """Teacher-forced reference on prompt + the engine's tokens: (top-1 agreement on decisive
    positions, max |logprob error| of the reference's top-1 token)."""
    import torch

    agree = total = 0
    err = 0.0
    for p, o, lp in zip(ps, outs, lps):
        with torch.no_grad():
            ref = hf(torch.tensor([p + o[:-1]], device=device)).logits[0, len(p) - 1:].float().log_softmax(-1).cpu()
        top2 = ref.topk(2, -1)
        decisive = (top2.values[:, 0] - top2.values[:, 1]) > MARGIN
        top = top2.indices[:, 0]
        agree += int(((lp.argmax(-1) == top) & decisive).sum())
        total += int(decisive.sum())
        err = max(err, float((lp.gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().max()))
    return (agree / total if total else 1.0), err


def parity(plan: Plan, paths: dict[str, Path], rep: Report) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from services.scheduler.attention.flashinfer_backend import available as flashinfer_available
    from services.scheduler.model_executor.model_runner import ModelRunner

    ps = prompts(plan)
    for name, path in paths.items():
        if not rep.fits(f"parity {name}", plan.budgets["parity"]):
            continue
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, plan.dtype))
        hf = hf.to(plan.device).eval()  # type: ignore[arg-type]  # transformers' stub types .to oddly
        for backend in plan.backends:
            if backend == "flashinfer" and (why := flashinfer_available()) is not None:
                rep.add(f"SKIP parity {name} flashinfer: {why}")
                continue
            for graphs in (True, False):
                t0 = time.monotonic()
                runner = ModelRunner(str(path), device=plan.device, dtype=plan.dtype, max_total_tokens=8192,
                                     max_running_requests=8, attention_backend=backend, cuda_graph_max_bs=8,
                                     disable_cuda_graph=not graphs, emulate_cuda_graph=plan.device == "cpu")
                if graphs and (runner.cuda_graph_runner is None or not runner.cuda_graph_runner.enabled):
                    rep.add(f"SKIP parity {name} {backend} graphs=on: backend not graph-capable")
                    continue
                outs, lps = engine_greedy(runner, ps, plan.gen_steps)
                top1, err = compare(hf, ps, outs, lps, plan.device)
                ok = top1 >= TOP1_MIN and err <= LOGPROB_TOL
                rep.add(f"parity {name:13s} {backend:10s} graphs={'on ' if graphs else 'off'} top1={top1:.3f} "
                        f"max_lp_err={err:.3f} {'PASS' if ok else 'FAIL'} ({time.monotonic() - t0:.1f}s)")
                del runner
        del hf
        if plan.device == "cuda":
            torch.cuda.empty_cache()


def overlap(plan: Plan, paths: dict[str, Path], rep: Report) -> None:
    from ringserve.message.sampling import SamplingParams
    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine

    if "disable_overlap_schedule" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        rep.add("SKIP overlap: this build has no --disable-overlap-schedule (EngineConfig.disable_overlap_schedule)")
        return
    name, path = next(iter(paths.items()))
    ps = prompts(plan)
    params = SamplingParams(temperature=0.0, max_new_tokens=plan.gen_steps, ignore_eos=True)
    outs = {}
    for disable in (False, True):
        t0 = time.monotonic()
        cfg = EngineConfig(model=str(path), device=plan.device, dtype=plan.dtype, max_total_tokens=8192,
                           max_running_requests=8, disable_overlap_schedule=disable)  # type: ignore[call-arg]
        eng = Engine(cfg)
        outs[disable] = [r.output_ids for r in eng.generate(ps, params)]
        rep.add(f"overlap {name} {'off' if disable else 'on '}: {time.monotonic() - t0:.1f}s")
        del eng
    rep.add(f"overlap {name}: greedy outputs {'IDENTICAL' if outs[False] == outs[True] else 'DIFFER'} on/off")


def decode_throughput(plan: Plan, paths: dict[str, Path], rep: Report) -> None:
    import torch

    from services.scheduler.model_executor.model_runner import ModelRunner

    for name, path in paths.items():
        if not rep.fits(f"decode {name}", plan.budgets["decode"]):
            continue
        max_bs = max(plan.batch_sizes)
        runner = ModelRunner(str(path), device=plan.device, dtype=plan.dtype, max_running_requests=max_bs,
                             max_total_tokens=max_bs * (plan.decode_prompt + plan.decode_steps + 8),
                             cuda_graph_max_bs=max_bs, emulate_cuda_graph=plan.device == "cpu")
        kv_token = runner.token_to_kv_pool.bytes_per_token
        for bs in plan.batch_sizes:
            g = torch.Generator().manual_seed(bs)
            ps = [torch.randint(10, 4000, (plan.decode_prompt,), generator=g).tolist() for _ in range(bs)]
            engine_greedy(runner, ps, 2)  # warm: kernels compiled, graphs of this size captured
            timing: list[float] = []
            engine_greedy(runner, ps, plan.decode_steps, timing)
            dt = timing[0]  # decode steps only (with the greedy argmax and its copy to the host, as served)
            tok_s = bs * plan.decode_steps / dt
            ctx = plan.decode_prompt + plan.decode_steps / 2
            step_bytes = runner.weights_bytes + bs * ctx * kv_token
            bound = bs / (step_bytes / HBM_BYTES_S)
            rep.add(f"decode {name:13s} bs={bs:<4d} {tok_s:10.1f} tok/s = {tok_s / bound:.3f} of the HBM bound "
                    f"({bound:.0f} tok/s at {HBM_BYTES_S / 1e12:.1f} TB/s) [{runner.attention_backend}, "
                    f"graphs {'on' if runner.cuda_graph_runner is not None else 'off'}]")
        del runner


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def gateway(plan: Plan, paths: dict[str, Path], rep: Report) -> None:
    import urllib.request

    from bench.ringserve_server import start_ringserve

    name, path = next(iter(paths.items()))
    timeout = max(10.0, min(plan.budgets["gateway"], rep.left() - 5))
    srv = start_ringserve(path, timeout=timeout, extra=["--scheduler-args", f"--device {plan.device}"])
    try:
        body = json.dumps({"input_ids": list(range(10, 74)), "sampling_params": {
            "temperature": 0, "max_new_tokens": plan.gateway_tokens, "ignore_eos": True}}).encode()

        def one(_: int) -> int:
            req = urllib.request.Request(f"{srv.gateway_url}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=max(rep.left(), 1)) as r:
                return int(json.loads(r.read())["meta_info"]["completion_tokens"])

        one(0)  # warm
        t0 = time.monotonic()
        with ThreadPoolExecutor(min(plan.gateway_requests, 64)) as pool:
            toks = sum(pool.map(one, range(plan.gateway_requests)))
        dt = time.monotonic() - t0
        rep.add(f"gateway {name}: {plan.gateway_requests} concurrent /generate x {plan.gateway_tokens} tokens: "
                f"{toks / dt:.1f} output tok/s through the four services ({dt:.1f}s)")
    finally:
        srv.server.stop()


LEGS: list[tuple[str, Callable[[Plan, dict[str, Path], Report], None]]] = [
    ("parity", parity), ("overlap", overlap), ("decode", decode_throughput), ("gateway", gateway)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every leg on CPU with tiny shapes")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="overall deadline (default 450)")
    ap.add_argument("--legs", default="parity,overlap,decode,gateway", help="comma-separated legs to run")
    ap.add_argument("--backends", default="triton,torch,flashinfer", help="attention backends of the parity leg")
    ap.add_argument("--models", default="", help="comma-separated model shapes to build and check (default all: "
                    f"{', '.join(SHAPES)}; with --cpu-smoke {', '.join(SMOKE_SHAPES)})")
    args = ap.parse_args(argv)
    base = SMOKE if args.cpu_smoke else GPU
    shapes = base.shapes
    if args.models:
        names = args.models.split(",")
        if unknown := [n for n in names if n not in base.shapes]:
            ap.error(f"--models: {', '.join(unknown)} not among {', '.join(base.shapes)}")
        shapes = {n: base.shapes[n] for n in names}
    plan = dataclasses.replace(base, shapes=shapes, backends=tuple(args.backends.split(",")))
    if args.cpu_smoke:
        # The Triton legs run in Triton's interpreter on CPU; set before anything imports triton.
        os.environ["TRITON_INTERPRET"] = "1"
    start = time.monotonic()
    rep = Report(start + args.deadline_s)
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(max(rep.left(), 0)):
            rep.add(f"DEADLINE: {args.deadline_s:.0f}s reached; legs still running were cut")
            rep.print()
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on CPU)", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu"
    rep.add(f"device {dev}; torch {torch.__version__}; deadline {args.deadline_s:.0f}s; tolerance: top1 >= "
            f"{TOP1_MIN} where margin > {MARGIN}, max logprob error <= {LOGPROB_TOL}")
    wanted = set(args.legs.split(","))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        paths = build_models(plan, Path(tmp), rep)
        for leg, fn in LEGS:
            if leg not in wanted or not rep.fits(leg, plan.budgets[leg]):
                continue
            try:
                fn(plan, paths, rep)
            except Exception as e:  # one leg's failure is a line in the report, not the end of the check
                rep.add(f"ERROR {leg}: {type(e).__name__}: {e}")
    rep.add(f"total {time.monotonic() - start:.1f}s")
    done.set()
    rep.print()
    return 1 if any(line.startswith(("ERROR", "DEADLINE")) or " FAIL " in f"{line} " or "DIFFER" in line
                    for line in rep.lines) else 0


if __name__ == "__main__":
    sys.exit(main())
