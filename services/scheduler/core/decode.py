"""The running batch: the requests that decode one token every step, and their retraction when the
KV pool cannot give each of them a slot.

A retracted request keeps its output ids; its prompt becomes prompt + output so far, so when it is
prefilled again it continues exactly where it stopped (greedy output is unchanged). Its KV goes into
the radix cache, so the recompute reuses whatever of it has not been evicted meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.scheduler.core.req import Req
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode


class RunningBatch:
    def __init__(self) -> None:
        self.reqs: list[Req] = []   # in admission order

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def retract(self, kv: KVManager) -> list[Req]:
        """Retract requests until every one left gets a new slot; returns them, first victim first.

        Victims are the requests with the least output (least work lost), longest prompt first, as in
        SGLang. At least one request is always kept.
        """
        if kv.available() >= len(self.reqs):
            return []
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        while len(order) > 1 and kv.available() < len(order):
            victim = order.pop()
            kv.release(victim, cache=True)
            victim.reset_for_recompute()
            retracted.append(victim)
        keep = set(map(id, order))
        self.reqs = [r for r in self.reqs if id(r) in keep]
        return retracted

    def forward_batch(self, slots: torch.Tensor, req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
        """The DECODE batch: one new token (the last sampled one) per request. slots: [B] int64, one new
        KV slot each. A decoding request has KV for all but its last token."""
        reqs = self.reqs
        pos = [r.kv_len for r in reqs]
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64).to(device)   # [B]
        positions = torch.tensor(pos, dtype=torch.int64).to(device)                          # [B]
        req_to_token[rows, positions] = slots  # one indexed write for the whole batch
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor([r.output_ids[-1] if r.future_id is None else r.future_id for r in reqs],
                                   dtype=torch.int64).to(device),  # [B], < 0: a placeholder (core/overlap.py)
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=rows,
            seq_lens=positions + 1,
            extend_lens=[1] * len(reqs),
            prefix_lens=pos,
            seq_lens_cpu=[p + 1 for p in pos],
        )
