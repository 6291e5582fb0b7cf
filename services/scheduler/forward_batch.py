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

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)
