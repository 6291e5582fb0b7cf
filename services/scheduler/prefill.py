"""Build the EXTEND forward batch for the requests the PrefillAdder took (slots already allocated)."""

from __future__ import annotations

import torch

from services.scheduler.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.req import Req


def build_extend_batch(reqs: list[Req], extend_lens: list[int], slots: list[torch.Tensor],
                       req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
    """Write each request's new slots into its req_to_token row and gather the new tokens."""
    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    prefix_lens: list[int] = []
    seq_lens: list[int] = []
    for req, n, loc in zip(reqs, extend_lens, slots):
        start = req.kv_len
        input_ids.extend(req.fill_ids[start:start + n])
        req_to_token[req.req_pool_idx, start:start + n] = loc
        positions.append(torch.arange(start, start + n, dtype=torch.int64))
        prefix_lens.append(start)
        seq_lens.append(start + n)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),    # [T]
        positions=torch.cat(positions).to(device),                         # [T]
        out_cache_loc=torch.cat(slots) if len(slots) > 1 else slots[0],    # [T] already on device
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64).to(device),  # [B]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),    # [B]
        extend_lens=list(extend_lens),
        prefix_lens=prefix_lens,
        seq_lens_cpu=seq_lens,
    )
