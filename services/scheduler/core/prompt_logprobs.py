"""Log probabilities of prompt tokens: SGLang's input_token_logprobs (`logprob_start_len`), vLLM's
prompt_logprobs, what OpenAI completions return with `echo` and `logprobs`, and what lm-eval's
loglikelihood tasks read.

A request scoring its prompt from position `start` needs the logits of every position from
start - 1 on. So the prefix cache may supply only the positions before that (`cache_cap`), the
prefill asks the runner for logits at all of the request's new positions from there
(`ForwardBatch.logit_rows`), and each chunk records, for each of its positions, the log-softmax of
the raw logits at the prompt token that follows it. Position 0 follows nothing: its entry has logprob
nan. A request recomputed after retraction keeps what it recorded and scores nothing twice.
"""

from __future__ import annotations

import math

import torch

from services.scheduler.core.req import Req
from services.scheduler.model_executor.forward_batch import ForwardBatch

NO_LOGPROB = math.nan  # position 0: no token before it to predict it
SLICE_ROWS = 512  # log-softmax this many positions at a time: a chunk's [T, V] is not copied whole
LOGIT_BYTES = 256 << 20  # per prefill step, the scored positions' logits (float32) at most: chunks are cut to fit
MIN_ROWS = 64


def rows_budget(vocab_size: int) -> int:
    """How many scored positions one prefill step may hold logits for (a 128k vocabulary: 512)."""
    return max(MIN_ROWS, LOGIT_BYTES // (4 * max(1, vocab_size)))


def seed(req: Req) -> None:
    """At intake: the entry of position 0 when scoring starts there."""
    if req.logprob_start_len == 0 and req.origin_input_ids and not req.input_logprobs:
        req.input_logprobs.append((req.origin_input_ids[0], NO_LOGPROB, None))


def next_position(req: Req) -> int:
    """The next prompt position to score (prompt_tokens once all are)."""
    return req.logprob_start_len + len(req.input_logprobs)


def wants(req: Req) -> bool:
    return 0 <= req.logprob_start_len and next_position(req) < req.prompt_tokens


def cache_cap(req: Req) -> int | None:
    """How many leading tokens the prefix cache may supply (None: no limit)."""
    return next_position(req) - 1 if wants(req) else None


def logit_rows(reqs: list[Req], extend_lens: list[int]) -> list[int] | None:
    """Per request of a prefill batch, how many of its last new tokens need logits (None: one each).
    Called before the pass: req.kv_len is where each request's new tokens start."""
    if not any(wants(r) for r in reqs):
        return None
    rows = []
    for req, n in zip(reqs, extend_lens):
        first = max(req.kv_len, next_position(req) - 1) if wants(req) else req.kv_len + n - 1
        rows.append(max(1, req.kv_len + n - first))
    return rows


def take(reqs: list[Req], batch: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
    """logits: the runner's output for batch: [B, V], or with batch.logit_rows [sum(logit_rows), V],
    each request's rows ending at its last new token (req.kv_len not yet advanced). Records the
    prompt logprobs they hold; returns the last row of each request [B, V]."""
    rows = batch.logit_rows
    if rows is None:
        return logits
    ends = torch.tensor(rows, device=logits.device).cumsum(0) - 1  # [B]
    start = 0
    for req, n, k in zip(reqs, batch.extend_lens, rows):
        block, start = logits[start:start + k], start + k
        if wants(req):
            _score(req, block, req.kv_len + n - k)
    return logits.index_select(0, ends)


def _score(req: Req, block: torch.Tensor, first_pos: int) -> None:
    """block: [k, V] logits at positions first_pos.. of req's sequence."""
    prompt = req.origin_input_ids
    lo = next_position(req) - 1 - first_pos          # row predicting the next unscored position
    hi = min(block.shape[0], len(prompt) - 1 - first_pos)  # rows whose next token is still prompt
    for a in range(max(lo, 0), hi, SLICE_ROWS):
        b = min(hi, a + SLICE_ROWS)
        lp = torch.log_softmax(block[a:b].float(), dim=-1)  # [m, V]
        targets = prompt[first_pos + a + 1:first_pos + b + 1]
        chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]] | None] = [None] * len(targets)
        if req.top_logprobs_num:
            top_v, top_i = lp.topk(req.top_logprobs_num, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        req.input_logprobs.extend(zip(targets, chosen, tops))
