"""Where a request spent its time, in seconds, one field per boundary (0: not measured).

Each service fills its own fields and passes the others on: the scheduler its four, the
detokenizer `detokenize_s` and the ring hops, the tokenizer the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.message.codec import fields_from_pb, fields_to_pb
from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Timings:
    tokenize_s: float = 0.0       # tokenizer: tokenization and chat template
    to_scheduler_s: float = 0.0   # tokenizer -> scheduler hop
    queue_s: float = 0.0          # scheduler: waiting queue until the first prefill chunk ran
    prefill_s: float = 0.0        # scheduler: prefill forward passes (all chunks)
    decode_s: float = 0.0         # scheduler: first scheduled until the last token was sampled
    ring_hops_s: float = 0.0      # scheduler -> detokenizer -> tokenizer hops, summed
    detokenize_s: float = 0.0     # detokenizer: decode work attributed to the request
    ttft_s: float = 0.0           # tokenizer: arrival until the first output token
    e2e_s: float = 0.0            # tokenizer: arrival until finished

    @classmethod
    def from_pb(cls, pb: common_pb2.Timings) -> Timings:
        return fields_from_pb(cls, pb)

    def to_pb(self) -> common_pb2.Timings:
        return fields_to_pb(self, common_pb2.Timings)
