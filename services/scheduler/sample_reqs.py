"""Sampling for a batch of requests: their state (params, generators, outputs so far, grammars, the
min_new_tokens stop ids) turned into one SamplingBatchInfo, the sampler run, and each request's
logprobs recorded. The glue between `Req` objects and sampling.py, as grammar_glue.py is for grammars.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.scheduler.core.finish import FinishChecker
from services.scheduler.grammar.glue import GrammarGlue
from services.scheduler.core.req import Req
from services.scheduler.model_executor.sampling import SamplingBatchInfo, sample


def sample_reqs(reqs: list[Req], logits: torch.Tensor, grammar: GrammarGlue, finisher: FinishChecker,
                vocab_size: int, device: torch.device,
                argmax: Callable[[torch.Tensor], list[int]] | None = None) -> list[int]:
    """logits: [len(reqs), V] on device, one row per request. Returns each request's next token id.
    argmax: the C kernel's, when the model runs on them."""
    if not reqs:
        return []
    grammar.mask(logits, reqs)
    info = SamplingBatchInfo.build(
        [r.params for r in reqs], [r.generator for r in reqs], [r.output_ids for r in reqs],
        [r.origin_input_ids for r in reqs],
        # A grammar decides for itself when EOS may come; masking it too could leave no token.
        [set(finisher.stop_ids_for_min_tokens(r))
         if r.params.min_new_tokens > len(r.output_ids) and r.grammar is None else set() for r in reqs],
        vocab_size, device)
    out = sample(logits, info, [r.return_logprob for r in reqs], [r.top_logprobs_num for r in reqs], argmax)
    for r, lp, top in zip(reqs, out.logprobs, out.top_logprobs):
        if r.return_logprob and r.params.max_tokens:  # 0: the token is not kept (scheduler.py)
            r.output_logprobs.append(lp)
            r.output_top_logprobs.append(top)
    return out.next_token_ids
