"""The prefill: which waiting requests go into the next one (their order, fcfs or lpm, and the
budgets), and the EXTEND forward batch of those it took.

`PrefillAdder` takes requests in order until one does not fit: the prefill token budget
(--max-prefill-tokens), the chunk budget (--chunked-prefill-size: the request that crosses it is cut
and finished in later steps), the running-request limit, and the KV pool, minus what the running
requests are expected to still need (`new_token_ratio` of their remaining max_new_tokens, as SGLang
estimates it, so that admitting prefills rarely forces a retraction).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from services.scheduler.core import prompt_logprobs
from services.scheduler.core.req import Req
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.kvcache.radix_cache import _common_len
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode

POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128       # matching every waiting request is O(queue); beyond this lpm acts as fcfs
RESERVE_CLIP = 4096       # cap on one request's reserved future tokens
# A waiting request that shares at least this many uncached tokens with one already in this prefill
# waits a step: the first computes the shared part, and the rest then find it in the radix cache
# (SGLang's in-batch prefix caching check).
IN_BATCH_PREFIX_MIN = 32

# --chunked-prefill-size when not given. On CPU, 2048 tokens (the per-step token budget vLLM's CPU
# backend uses): with a decode step after each prefill step, a burst's first tokens come out chunk
# by chunk instead of after the whole burst. A GPU's prefill is cheap per token; bigger chunks fill it.
CPU_CHUNK, CUDA_CHUNK = 2048, 8192

# SGLang's defaults for the estimate of how many of max_new_tokens a request will really use.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600


@dataclass(frozen=True)
class NewTokenRatio:
    """The estimate's schedule: `init` after a retraction (and at start), falling by `decay` a decode
    step to `floor`. SGLang's --schedule-conservativeness scales it: below 1 admits more requests at
    once and retracts more often, above 1 the reverse."""
    init: float
    floor: float
    decay: float

    @classmethod
    def scaled(cls, conservativeness: float = 1.0) -> NewTokenRatio:
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        floor = min(MIN_NEW_TOKEN_RATIO * conservativeness, init)
        return cls(init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS)


def default_chunk_size(configured: int | None, device: torch.device) -> int:
    if configured is not None:
        return configured
    return CUDA_CHUNK if device.type == "cuda" else CPU_CHUNK


def order_waiting(waiting: deque[Req], policy: str, kv: KVManager) -> None:
    """Sort the queue in place for this step; matches prefixes (lpm needs them; fcfs gets them at add)."""
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        for req in waiting:
            if req.req_pool_idx is None:
                kv.match(req)
        # Stable: equal matches keep arrival order. A chunked request in progress stays first.
        ranked = sorted(waiting, key=lambda r: (r.req_pool_idx is None, -_prefix_len(r)))
        waiting.clear()
        waiting.extend(ranked)


def _prefix_len(req: Req) -> int:
    return 0 if req.prefix_indices is None else int(req.prefix_indices.numel())


def reserved_tokens(req: Req, ratio: float) -> int:
    """Tokens the request is expected to still write during decode."""
    left = max(0, req.params.max_tokens - len(req.output_ids))
    return int(min(left, RESERVE_CLIP) * ratio)


AddResult = Literal["added", "chunked", "stop", "defer"]


class PrefillAdder:
    """One step's prefill: the requests taken so far, their new tokens and KV slots, and the budgets left."""

    def __init__(self, kv: KVManager, running: Sequence[Req], max_prefill_tokens: int,
                 chunked_prefill_size: int, max_running_requests: int, new_token_ratio: float,
                 vocab_size: int = 0, max_loras: int = 0) -> None:
        self.kv = kv
        # Requests scoring their prompt keep logits for every new position: [rows, vocab] floats.
        self.rem_scored = prompt_logprobs.rows_budget(vocab_size)
        self.ratio = new_token_ratio
        self.running_empty = not running
        self.rem_total = kv.available() - sum(reserved_tokens(r, new_token_ratio) for r in running)
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.can_run = max_running_requests - len(running)
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        self.slots: list[torch.Tensor] = []   # [extend_len] int64 KV slots per added request
        self.chunked: Req | None = None
        # LoRA: the running requests decode with this step's prefill (mixed) or right after it, so the
        # distinct adapters of both together must fit the slots (--max-loras-per-batch).
        self.max_loras = max_loras
        self.loras = {r.lora_uid for r in running if r.lora_uid}

    def _shares_uncached_prefix(self, req: Req, prefix_len: int) -> bool:
        for other in self.reqs:
            if other.lora_uid != req.lora_uid:  # another adapter's KV is no use to it
                continue
            if _common_len(req.fill_ids, other.fill_ids) - prefix_len >= IN_BATCH_PREFIX_MIN:
                return True
        return False

    def add(self, req: Req) -> AddResult:
        """Try to add req, allocating its KV slots now. "stop" means take no more this step."""
        continuing = req.req_pool_idx is not None  # a chunked request from an earlier step
        if not continuing:
            if self.can_run <= 0:
                return "stop"
            if req.lora_uid and req.lora_uid not in self.loras and len(self.loras) >= self.max_loras:
                return "defer"  # its adapter would be one too many in this batch: a later step
            self.kv.match(req)  # always fresh: an older match may point at evicted slots
            prefix_len = _prefix_len(req)
            # A request scoring its prompt could not take the shared part from the cache anyway.
            if not prompt_logprobs.wants(req) and self._shares_uncached_prefix(req, prefix_len):
                return "defer"
        else:
            prefix_len = req.kv_len
        extend = len(req.fill_ids) - prefix_len
        budget = self.rem_input if self.rem_chunk is None else min(self.rem_input, self.rem_chunk)
        scored = prompt_logprobs.wants(req)
        if scored:
            budget = min(budget, self.rem_scored)
        first = not self.reqs
        if extend <= budget or (first and self.rem_chunk is None and not scored):
            need = extend + reserved_tokens(req, self.ratio)
            # With nothing running and nothing taken, only the prompt itself must fit: progress is
            # always possible for a request that fits the pool at all.
            fits = need <= self.rem_total or (first and self.running_empty and extend <= self.kv.available())
            if not fits:
                return "stop"
            take, result = extend, "added"
        elif self.rem_chunk is None and not scored:
            return "stop"  # over the prefill budget and not first: next step
        else:
            take = min(budget, self.rem_total)
            if take <= 0:
                return "stop"
            result = "chunked"
        before = self.kv.available()
        if not continuing and not self.kv.begin(req):  # locks the prefix so allocation cannot evict it
            return "stop"
        slots = self.kv.alloc(take)
        if slots is None:
            if not continuing:
                self.kv.release(req, cache=False)
            return "stop"
        self.reqs.append(req)
        if req.lora_uid:
            self.loras.add(req.lora_uid)
        self.extend_lens.append(take)
        self.slots.append(slots)
        # Locking the prefix also took it out of what is evictable: charge what really went.
        self.rem_total -= (before - self.kv.available()) + (
            reserved_tokens(req, self.ratio) if result == "added" else 0)
        self.rem_input -= take
        if scored:
            self.rem_scored -= take
        if self.rem_chunk is not None:
            self.rem_chunk -= take
        self.can_run -= 1
        if result == "chunked":
            self.chunked = req
            return "chunked"
        return "added" if self.rem_input > 0 and (self.rem_chunk is None or self.rem_chunk > 0) else "stop"

    def forward_batch(self, req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
        """The EXTEND batch of the requests taken: each one's new slots written into its req_to_token
        row, its new tokens gathered."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        prefix_lens: list[int] = []
        seq_lens: list[int] = []
        for req, n, loc in zip(self.reqs, self.extend_lens, self.slots, strict=True):
            start = req.kv_len
            input_ids.extend(req.fill_ids[start:start + n])
            req_to_token[req.req_pool_idx, start:start + n] = loc
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            prefix_lens.append(start)
            seq_lens.append(start + n)
        slots = self.slots
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),    # [T]
            positions=torch.cat(positions).to(device),                         # [T]
            out_cache_loc=torch.cat(slots) if len(slots) > 1 else slots[0],    # [T] already on device
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64).to(device),  # [B]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),    # [B]
            extend_lens=list(self.extend_lens),
            prefix_lens=prefix_lens,
            seq_lens_cpu=seq_lens,
            logit_rows=prompt_logprobs.logit_rows(self.reqs, self.extend_lens),
        )
