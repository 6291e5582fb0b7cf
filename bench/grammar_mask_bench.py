"""Mask cost per decode step: `python -m bench.grammar_mask_bench [--model DIR] [--vocab N]`.

For batch 1/8/32 every row is constrained by the same JSON schema, matchers are advanced by masked
random decoding (so they sit mid-output, not at the start), and each timed step is fill + apply on
[B, V] float32 CPU logits. --vocab pads the logits (and mask) to N columns to see how width scales.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ringserve.text_tokenizer import TextTokenizer, default_model
from services.scheduler.grammar import GrammarMasker, load_backend

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}


def bench(model: str, vocab: int | None, batches: list[int], steps: int) -> None:
    tok = TextTokenizer.from_model(model)
    cfg = json.loads(open(f"{model}/config.json").read())
    width = vocab or cfg["vocab_size"]
    t0 = time.perf_counter()
    backend = load_backend("xgrammar", model, width, tok.eos_token_ids)
    if backend is None:
        raise SystemExit("xgrammar is not installed")
    print(f"backend load {time.perf_counter() - t0:.2f}s  vocab(logits width)={width}")
    t0 = time.perf_counter()
    compiled = backend.compile("json_schema", json.dumps(SCHEMA))
    print(f"compile json_schema {1000 * (time.perf_counter() - t0):.1f} ms")
    g = torch.Generator().manual_seed(0)
    for bs in batches:
        masker = GrammarMasker(backend, max(batches))
        matchers = [compiled.matcher() for _ in range(bs)]
        times = []
        for _ in range(steps):
            logits = torch.randn(bs, width, generator=g)  # [B, V]
            t = time.perf_counter()
            masker.apply(logits, matchers)
            times.append(time.perf_counter() - t)
            picks = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0].tolist()
            for i, (m, p) in enumerate(zip(matchers, picks)):
                if not m.accept_token(p) or m.is_terminated():
                    matchers[i] = compiled.matcher()  # start a new output in that row
        times.sort()
        print(f"batch {bs:3d}: mask {1000 * sum(times) / len(times):.3f} ms/step mean, "
              f"p50 {1000 * times[len(times) // 2]:.3f}, p90 {1000 * times[int(len(times) * 0.9)]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: the model's vocab_size)")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    bench(args.model, args.vocab, [1, 8, 32], args.steps)


if __name__ == "__main__":
    main()
