"""What one forward pass computes: the contract between the scheduler and the model runner.

The scheduler decides which tokens run and where their KV goes (it has already written
`out_cache_loc` into `req_to_token` for each request's new positions); the model runner only reads
this and the pools. Tensors live on the runner's device unless noted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # prefill (or a prefill chunk) of one or more requests, possibly after a cached prefix
    DECODE = auto()  # exactly one new token for every request in the batch


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor        # [T] int64: the new tokens of every request, request by request
    positions: torch.Tensor        # [T] int64: position of each new token in its sequence
    out_cache_loc: torch.Tensor    # [T] int64: KV pool slot each new token's K/V is written to
    req_pool_indices: torch.Tensor # [B] int64: row of req_to_token for each request
    seq_lens: torch.Tensor         # [B] int64: tokens per request after this pass (prefix + new)
    extend_lens: list[int]         # [B] on CPU: new tokens per request (all 1 in DECODE)
    prefix_lens: list[int]         # [B] on CPU: tokens already in the KV pool before this pass
    seq_lens_cpu: list[int]        # [B] on CPU: same as seq_lens
    # EXTEND only: the last num_decode requests are running requests decoding one token each (a
    # mixed step); attention reads their KV as a DECODE batch would.
    num_decode: int = 0
    # EXTEND only: how many of each request's last new tokens get logits (None: one each), for
    # requests that score their prompt (prompt_logprobs.py).
    logit_rows: list[int] | None = None
    # [B] on CPU: each request's LoRA adapter uid (0: the base model); None when no request has one,
    # so a batch without adapters costs nothing (services/scheduler/lora/).
    lora_ids: list[int] | None = None
    # DECODE only: every request takes its logits' argmax and nothing else reads them (no logprobs, penalties,
    # bias, grammar, ...): the forward may return [B] int64 argmax ids in their place (a fused lm_head).
    greedy: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @classmethod
    def mix(cls, extend: ForwardBatch, decode: ForwardBatch) -> ForwardBatch:
        """A mixed step (SGLang's --enable-mixed-chunk, vLLM's default): one EXTEND batch of the prefill
        requests, then the running requests' decode tokens (num_decode of them). The linears take both
        in one pass over the weights; attention runs the two parts apart (`split`)."""
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=torch.cat([extend.input_ids, decode.input_ids]),              # [T + B_d]
            positions=torch.cat([extend.positions, decode.positions]),              # [T + B_d]
            out_cache_loc=torch.cat([extend.out_cache_loc, decode.out_cache_loc]),  # [T + B_d]
            req_pool_indices=torch.cat([extend.req_pool_indices, decode.req_pool_indices]),  # [B_e + B_d]
            seq_lens=torch.cat([extend.seq_lens, decode.seq_lens]),                 # [B_e + B_d]
            extend_lens=extend.extend_lens + decode.extend_lens,
            prefix_lens=extend.prefix_lens + decode.prefix_lens,
            seq_lens_cpu=extend.seq_lens_cpu + decode.seq_lens_cpu,
            num_decode=decode.batch_size,
            logit_rows=None if extend.logit_rows is None else extend.logit_rows + [1] * decode.batch_size,
            lora_ids=(None if extend.lora_ids is None and decode.lora_ids is None else
                      (extend.lora_ids or [0] * extend.batch_size) + (decode.lora_ids or [0] * decode.batch_size)),
        )

    def split(self) -> tuple[ForwardBatch, ForwardBatch, int]:
        """A mixed batch back into its EXTEND and DECODE parts, and the number of prefill tokens."""
        batch = self
        b = batch.batch_size - batch.num_decode
        t = sum(batch.extend_lens[:b])
        extend = ForwardBatch(
            ForwardMode.EXTEND, batch.input_ids[:t], batch.positions[:t], batch.out_cache_loc[:t],
            batch.req_pool_indices[:b], batch.seq_lens[:b], batch.extend_lens[:b], batch.prefix_lens[:b],
            batch.seq_lens_cpu[:b], lora_ids=None if batch.lora_ids is None else batch.lora_ids[:b])
        decode = ForwardBatch(
            ForwardMode.DECODE, batch.input_ids[t:], batch.positions[t:], batch.out_cache_loc[t:],
            batch.req_pool_indices[b:], batch.seq_lens[b:], batch.extend_lens[b:], batch.prefix_lens[b:],
            batch.seq_lens_cpu[b:], lora_ids=None if batch.lora_ids is None else batch.lora_ids[b:])
        return extend, decode, t
