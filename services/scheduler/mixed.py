"""A mixed step: a prefill batch with the running requests' decode tokens appended (SGLang's
--enable-mixed-chunk, vLLM's default).

Without it a prefill step stalls every running request for the length of the prefill; with it the
running requests decode one token in the same forward pass. The linear layers take their rows
along with the prompt tokens (one pass over the weights for both), and attention runs the two parts
apart (`TorchSDPABackend`: the prefill rows as an EXTEND batch, the decode rows as a DECODE batch).
"""

from __future__ import annotations

import torch

from services.scheduler.forward_batch import ForwardBatch, ForwardMode


def mix(extend: ForwardBatch, decode: ForwardBatch) -> ForwardBatch:
    """One EXTEND batch: the prefill requests, then the decode requests (num_decode of them)."""
    return ForwardBatch(
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
    )


def split(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch, int]:
    """A mixed batch back into its EXTEND and DECODE parts, and the number of prefill tokens."""
    b = batch.batch_size - batch.num_decode
    t = sum(batch.extend_lens[:b])
    extend = ForwardBatch(
        ForwardMode.EXTEND, batch.input_ids[:t], batch.positions[:t], batch.out_cache_loc[:t],
        batch.req_pool_indices[:b], batch.seq_lens[:b], batch.extend_lens[:b], batch.prefix_lens[:b],
        batch.seq_lens_cpu[:b])
    decode = ForwardBatch(
        ForwardMode.DECODE, batch.input_ids[t:], batch.positions[t:], batch.out_cache_loc[t:],
        batch.req_pool_indices[b:], batch.seq_lens[b:], batch.extend_lens[b:], batch.prefix_lens[b:],
        batch.seq_lens_cpu[b:])
    return extend, decode, t
