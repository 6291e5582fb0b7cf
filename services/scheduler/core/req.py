"""One request inside the scheduler: its ids, where its KV lives, how far it got, and its status.

KV ownership (page size 1, as in SGLang): `req_to_token[req_pool_idx, :kv_len]` holds the KV slots of
the first `kv_len` tokens of `fill_ids`. The first `len(prefix_indices)` of them belong to the radix
cache (kept alive by a lock on `last_node`); the rest belong to the request until it releases them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ringserve.message import Finish, SamplingParams, Timings, TokenizedReq

TopLogprobs = list[tuple[int, float]]                          # (token id, logprob), most likely first
PromptLogprob = tuple[int, float, TopLogprobs | None]          # (token id, logprob, alternatives)


class ReqStatus(Enum):
    """Where a request is. The scheduler sets it whenever it moves the request between its containers."""

    GRAMMAR = "grammar"      # in the grammar queue until its constraint compiles (holds no KV)
    WAITING = "waiting"      # in the waiting queue (again after a retraction)
    PREFILL = "prefill"      # mid-prefill: its prompt goes in chunks over several steps
    RUNNING = "running"      # in the running batch, decoding one token per step
    FINISHED = "finished"    # finished, aborted or refused; finished_reason says which


@dataclass
class ReqTimings:
    """Monotonic clock marks; durations are derived when the request finishes."""

    arrival: float = 0.0              # time.monotonic() at submit
    sent_at: float = 0.0              # unix time the tokenizer sent it (0 if unknown)
    arrived_at: float = 0.0           # unix time it arrived here (the hop's other end)
    first_scheduled: float = 0.0      # first prefill chunk started
    prefill_s: float = 0.0            # summed prefill forward time attributed to it
    last_token: float = 0.0           # last token sampled

    @property
    def to_scheduler_s(self) -> float:
        """The tokenizer -> scheduler hop (wall clocks: on two hosts it includes their skew)."""
        return max(0.0, self.arrived_at - self.sent_at) if self.sent_at and self.arrived_at else 0.0

    @property
    def queue_s(self) -> float:
        return max(0.0, self.first_scheduled - self.arrival) if self.first_scheduled else 0.0

    @property
    def decode_s(self) -> float:
        return max(0.0, self.last_token - self.first_scheduled) if self.first_scheduled else 0.0

    def measured(self) -> Timings:
        """The scheduler's part of the request's Timings."""
        return Timings(to_scheduler_s=self.to_scheduler_s, queue_s=self.queue_s, prefill_s=self.prefill_s,
                       decode_s=self.decode_s)


@dataclass(eq=False)  # identity equality: reqs live in lists and sets by object
class Req:
    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    owner: str = ""
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    # Overlap scheduling (core/overlap.py): the placeholder (< 0) of a token sampled by a forward still
    # in flight; the next decode step takes it as its input id, resolved where that forward runs.
    future_id: int | None = None
    # The chosen token's logprob and its top alternatives, per output token (when asked for).
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # Prompt logprobs (prompt_logprobs.py): from this position on (-1: none), as (token id, logprob,
    # top alternatives) per prompt position; position 0 has no logprob (nan).
    logprob_start_len: int = -1
    input_logprobs: list[PromptLogprob] = field(default_factory=list)
    input_logprobs_sent: bool = False

    # KV state.
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor | None = None   # [P] int64 slots owned by the radix cache
    last_node: Any = None                         # radix node locked for prefix_indices
    kv_len: int = 0                               # tokens of fill_ids with KV in the pool
    fill_ids: list[int] = field(default_factory=list)  # tokens to prefill: prompt (+ output on recompute)
    cached_tokens: int = 0                        # prompt tokens served from the prefix cache (max seen)
    weight_version: str = ""                      # of the weights of its last prefill (its outputs report it)
    # Its LoRA adapter: the name the tokenizer sent and the uid the engine resolved it to at intake
    # (0: the base model). The uid keys its prefix-cache namespace and its rows' updates.
    lora_name: str = ""
    lora_uid: int = 0

    status: ReqStatus = ReqStatus.WAITING
    finished_reason: Finish | None = None
    generator: torch.Generator | None = None
    timings: ReqTimings = field(default_factory=ReqTimings)
    sent_offset: int = 0            # output ids already emitted
    params_sent: bool = False       # DecodeParams went out with an earlier delta
    num_retractions: int = 0
    # Text tail decoded for stop strings (set by finish.py when the request has stop strings).
    stop_tail_tokens: int = 0
    # Its GrammarMatcher while it has a constraint: set when the grammar queue hands it over, kept
    # across retraction (the output it matched is kept too), dropped at finish or abort.
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.fill_ids:
            self.fill_ids = list(self.origin_input_ids)
        if not self.timings.arrival:
            self.timings.arrival = time.monotonic()

    @classmethod
    def from_tokenized(cls, t: TokenizedReq, owner: str) -> Req:
        """The scheduler's state for a request from a tokenizer replica (`owner` when it names none)."""
        return cls(rid=t.rid, owner=t.owner or owner, origin_input_ids=t.input_ids, params=t.sampling,
                   stream=t.stream, return_logprob=t.return_logprob, top_logprobs_num=t.top_logprobs_num,
                   logprob_start_len=t.logprob_start_len, lora_name=t.lora_name,
                   timings=ReqTimings(arrival=time.monotonic(), sent_at=t.sent_at, arrived_at=time.time()))

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        """Prompt plus output: the tokens the request's sequence holds (the last one has no KV yet)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def reset_for_recompute(self) -> None:
        """After retraction: the prompt becomes prompt + output so far; KV is gone."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        self.req_pool_idx = None
        self.prefix_indices = None
        self.last_node = None
        self.kv_len = 0
        self.num_retractions += 1
        self.status = ReqStatus.WAITING
