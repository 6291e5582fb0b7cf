"""Steady-state decode throughput: N concurrent streaming requests, one new token each per step.

    python -m bench.detokenizer_bench [--requests 256] [--steps 400] [--model M] [--stop] [--logprobs K]

Prints, per core (CPU time of this process, so other load on the machine does not skew it; the
tokenizers library's own thread pool is switched off):
  - the decode state alone (IncrementalDecoder.step), microseconds per token, on four kinds of text
    (English, code, emoji/CJK, and a run of rare emoji whose every character the byte-level BPE splits
    across ids), skip_special_tokens both ways, for each path: the batched Python decode, the
    DecodeStream path as the decoder runs it (with the window it mirrors), and bare
    tokenizers.decoders.DecodeStream.step calls (the floor);
  - tokens/s for the core (Detokenizer.step on dataclasses) and through the servicer
    (protobuf StepBatch in -> decode -> SubscribeResponse per owner queued to subscribers).
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers starts its pool
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402

from tokenizers.decoders import DecodeStream  # noqa: E402

from ringserve.message import DecodeParams, Logprob, SamplingParams, StepBatch, TokenDelta  # noqa: E402
from ringserve.text_tokenizer import TextTokenizer, default_model  # noqa: E402
from ringserve.v1 import detokenizer_pb2 as pb  # noqa: E402
from services.detokenizer.config import DetokenizerConfig  # noqa: E402
from services.detokenizer.decode_state import DecodeJob, IncrementalDecoder  # noqa: E402
from services.detokenizer.detokenizer import Detokenizer  # noqa: E402
from services.detokenizer.server import build_servicer  # noqa: E402

TEXT = ("The detokenizer turns token ids into text, one step at a time. 東京は日本の首都です。"
        "Emoji 😀🚀👍🏽 and naïve café résumé. 我们喜欢机器学习。 The quick brown fox jumps. ") * 8
OWNERS = 4
# The decode-state comparison's texts: what a chat model streams, and the worst case for holding back.
KINDS = {
    "english": "Serving language models means streaming text one token at a time, and the detokenizer "
               "turns every new token id into the text the client sees next. ",
    "code": "def merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:\n"
            "    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}  # sum\n",
    "emoji_cjk": "東京は日本の首都です。我们喜欢机器学习。 Emoji 😀🚀👍🏽 naïve café. 한국어 텍스트. ",
    "split_utf8": "🦀🧬🪐🫠🧿🪷🫧🦩🪸🧊",
}


def token_stream(tok: TextTokenizer, n: int) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def params(i: int, stop: bool) -> DecodeParams:
    return DecodeParams(owner=f"tok-{i % OWNERS}",
                        sampling=SamplingParams(stop=("fox jumps over", "</answer>") if stop else ()))


def logprobs(token_id: int, k: int) -> list[Logprob]:
    """What a request asking for logprobs with k alternatives gets per token (none when k < 0)."""
    if k < 0:
        return []
    return [Logprob(token_id, -0.5, tuple((token_id + j, -1.0 - j) for j in range(k)))]


def bench_decode_state(tok: TextTokenizer, ids: list[int], n_req: int, steps: int, skip: bool,
                       path: str) -> float:
    """CPU microseconds per token of n_req requests decoding one token each per step (each request
    starts at another point of `ids`); path: python, stream, or bare (DecodeStream.step alone)."""
    stream = ids * ((n_req + steps) // len(ids) + 1)
    if path == "bare":
        raw = tok.tokenizer
        streams = [DecodeStream(skip_special_tokens=skip) for _ in range(n_req)]
        t0 = time.process_time()
        for s in range(steps):
            for i, ds in enumerate(streams):
                ds.step(raw, stream[i + s])
        return (time.process_time() - t0) / (n_req * steps) * 1e6
    dec = IncrementalDecoder(tok, use_stream=path == "stream")
    states = [dec.new_state(skip) for _ in range(n_req)]
    t0 = time.process_time()
    for s in range(steps):
        for i, st in enumerate(states):
            st.append([stream[i + s]])
        dec.step([DecodeJob(st, False) for st in states])
    return (time.process_time() - t0) / (n_req * steps) * 1e6


def print_decode_state(tok: TextTokenizer, n_req: int, steps: int) -> None:
    print(f"decode state alone (IncrementalDecoder.step): {n_req} requests x {steps} steps, "
          "CPU us per token (python: batched decode + commit loop; stream: DecodeStream path; "
          "bare: DecodeStream.step calls only)")
    for kind, text in KINDS.items():
        ids = tok.encode(text * 4, add_special_tokens=False)
        held = sum(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids))) / len(ids)
        for skip in (True, False):
            us = {p: bench_decode_state(tok, ids, n_req, steps, skip, p) for p in ("python", "stream", "bare")}
            print(f"  {kind:<10} skip_special={'yes' if skip else 'no ':<3} (ids ending mid-character: "
                  f"{held:4.0%})  python {us['python']:5.2f}  stream {us['stream']:5.2f}  bare {us['bare']:5.2f}"
                  f"  -> {us['python'] / us['stream']:.1f}x")


def bench_core(tok: TextTokenizer, n_req: int, steps: int, stop: bool, k: int) -> float:
    det = Detokenizer(tok)
    stream = token_stream(tok, steps + n_req + 4)
    # Warm-up step carrying params (and a few tokens) for every request.
    det.step(StepBatch([TokenDelta(f"r{i}", stream[i:i + 4], 0, params(i, stop)) for i in range(n_req)]))
    batches = [StepBatch([TokenDelta(f"r{i}", [stream[i + s + 4]], s + 4,
                                     logprobs=logprobs(stream[i + s + 4], k)) for i in range(n_req)])
               for s in range(steps)]
    t0 = time.process_time()
    for b in batches:
        det.step(b)
    return n_req * steps / (time.process_time() - t0)


async def bench_servicer(tok: TextTokenizer, n_req: int, steps: int, stop: bool, k: int) -> float:
    servicer = build_servicer(DetokenizerConfig(model="bench", metrics_port=-1), tok)
    subs = [servicer.subs.subscribe(f"tok-{o}") for o in range(OWNERS)]

    async def drain(sub) -> None:  # type: ignore[no-untyped-def]
        while await sub.get() is not None:
            pass

    drains = [asyncio.create_task(drain(s)) for s in subs]
    stream = token_stream(tok, steps + n_req + 4)
    first = pb.StepBatch(deltas=[pb.TokenDelta(
        rid=f"r{i}", offset=0, ids=stream[i:i + 4],
        params=params(i, stop).to_pb()) for i in range(n_req)])
    await servicer.handle_batch(first)
    batches = [pb.StepBatch(deltas=[pb.TokenDelta(rid=f"r{i}", offset=s + 4, ids=[stream[i + s + 4]],
                                                  logprobs=Logprob.list_to_pb(logprobs(stream[i + s + 4], k)))
                                    for i in range(n_req)]).SerializeToString() for s in range(steps)]
    t0 = time.process_time()
    for raw in batches:  # parse included: that is what the gRPC layer hands the servicer
        await servicer.handle_batch(pb.StepBatch.FromString(raw))
    elapsed = time.process_time() - t0
    servicer.close()
    await asyncio.gather(*drains)
    return n_req * steps / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--stop", action="store_true", help="give every request two stop strings")
    ap.add_argument("--logprobs", type=int, default=-1, metavar="K",
                    help="every token carries its logprob and K alternatives (default: no logprobs)")
    args = ap.parse_args()
    tok = TextTokenizer.from_model(args.model)
    print_decode_state(tok, args.requests, max(1, args.steps // 4))
    core = bench_core(tok, args.requests, args.steps, args.stop, args.logprobs)
    via = asyncio.run(bench_servicer(tok, args.requests, args.steps, args.stop, args.logprobs))
    print(f"detokenizer bench: {args.requests} concurrent requests x {args.steps} steps, "
          f"stop strings: {'yes' if args.stop else 'no'}, "
          f"logprobs: {args.logprobs if args.logprobs >= 0 else 'no'}, "
          "tokens per CPU-second of one core")
    print(f"  core (Detokenizer.step):          {core:>10,.0f} tokens/s")
    print(f"  servicer (protobuf in/out+route): {via:>10,.0f} tokens/s")
    print(f"  target >= 50,000 tokens/s: {'met' if min(core, via) >= 50_000 else 'NOT met'}")


if __name__ == "__main__":
    main()
