"""Build the DECODE forward batch: one new token (the last sampled one) for every running request."""

from __future__ import annotations

import torch

from services.scheduler.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.req import Req


def build_decode_batch(reqs: list[Req], slots: torch.Tensor, req_to_token: torch.Tensor,
                       device: torch.device) -> ForwardBatch:
    """slots: [B] int64, one new KV slot per request. A decoding request has KV for all but its last token."""
    pos = [r.kv_len for r in reqs]
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64).to(device)   # [B]
    positions = torch.tensor(pos, dtype=torch.int64).to(device)                          # [B]
    req_to_token[rows, positions] = slots  # one indexed write for the whole batch
    seq_lens_cpu = [p + 1 for p in pos]
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64).to(device),  # [B]
        positions=positions,
        out_cache_loc=slots,
        req_pool_indices=rows,
        seq_lens=positions + 1,
        extend_lens=[1] * len(reqs),
        prefix_lens=pos,
        seq_lens_cpu=seq_lens_cpu,
    )
