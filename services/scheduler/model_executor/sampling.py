"""Sampling parameters, their per-step batch tensors, and `sample`.

Order of operations on the logits of one step ([B, V] float32):
1. penalties: repetition (CTRL-style, over prompt + output), frequency/presence (over output);
2. logit_bias: one index_add of the batch's sparse (row, token, bias) entries (LogitBias);
3. min_new_tokens: EOS and stop ids masked while the output is shorter than the minimum;
4. greedy rows: argmax; other rows: temperature, then top_k / top_p / min_p (all measured on the
   full post-temperature distribution, as SGLang does), then a draw.
Seeded requests draw with their own torch.Generator, row by row, so a seed gives the same tokens
whatever the batch. Logprobs are taken from the raw logits (before penalties, logit_bias and
temperature): vLLM's default (logprobs_mode "raw_logprobs"), so a bias that forces a token does not
also make its reported logprob 0; they score the model, not the sampler's edit of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ringserve.message import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative int64 seeds map to a valid uint64
    return g


class LogitBias:
    """The logit_bias entries of a batch as two device tensors: flat indices row * V + token [N] int64
    and biases [N] float32, for one index_add into the flattened [B * V] logits (no per-row work).

    Keyed by the biased rows and their biases, so a batch keeps its tensors for as long as its biased
    rows stay where they are (a decode batch keeps its composition for many steps); the last few
    keys are kept, since prefill and decode steps alternate. Rows without a bias add nothing."""

    KEEP = 4

    def __init__(self) -> None:
        self._built: dict[tuple[tuple[int, tuple[tuple[int, float], ...]], ...],
                          tuple[torch.Tensor, torch.Tensor]] = {}

    def tensors(self, params: list[SamplingParams], vocab_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = tuple((i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias)
        if not key:
            return None
        built = self._built.get(key)
        if built is None:
            # The tokenizer checked the ids against its vocabulary; one the model's logits lack (a
            # tokenizer larger than the model's head) could never be sampled, so it has no logit to bias.
            entries = [(row * vocab_size + token, b) for row, bias in key for token, b in bias if token < vocab_size]
            index, values = [e[0] for e in entries], [e[1] for e in entries]
            built = (torch.tensor(index, dtype=torch.int64).to(device),
                     torch.tensor(values, dtype=torch.float32).to(device))
            if len(self._built) >= self.KEEP:
                del self._built[next(iter(self._built))]  # the oldest
            self._built[key] = built
        return built


class SampleOutput(NamedTuple):
    next_token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass
class SamplingBatchInfo:
    """One step's sampling state. `fast_greedy`: nothing but argmax is needed (nothing else is built)."""

    fast_greedy: bool
    batch_size: int
    greedy: list[bool] | None = None
    generators: list[torch.Generator | None] | None = None
    temperatures: torch.Tensor | None = None     # [B, 1] float32 (1.0 on greedy rows)
    top_ks: torch.Tensor | None = None           # [B] int64 (V where off), or None when no row uses top_k
    top_ps: torch.Tensor | None = None           # [B] float32, or None
    min_ps: torch.Tensor | None = None           # [B] float32, or None
    rep_penalties: torch.Tensor | None = None    # [B, 1] float32, or None
    rep_mask: torch.Tensor | None = None         # [B, V] bool: token in prompt or output
    freq_penalties: torch.Tensor | None = None   # [B, 1] float32, or None
    pres_penalties: torch.Tensor | None = None   # [B, 1] float32
    counts: torch.Tensor | None = None           # [B, V] float32: occurrences in the output
    min_token_mask: list[tuple[int, list[int]]] | None = None  # (row, ids to mask)
    bias_index: torch.Tensor | None = None       # [N] int64 row * V + token (LogitBias), or None
    bias_values: torch.Tensor | None = None      # [N] float32

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              output_ids: list[list[int]], prompt_ids: list[list[int]], stop_ids_for_min_tokens: list[set[int]],
              vocab_size: int, device: torch.device | str, logit_bias: LogitBias | None = None) -> SamplingBatchInfo:
        """logit_bias: the caller's cache of bias tensors (a fresh one when None: built every call)."""
        bs = len(params)
        min_mask = [(i, sorted(t for t in stop_ids_for_min_tokens[i] if 0 <= t < vocab_size))
                    for i, p in enumerate(params) if len(output_ids[i]) < p.min_new_tokens]
        min_mask = [(i, ids) for i, ids in min_mask if ids]
        if not min_mask and all(p.argmax_of_logits for p in params):
            return cls(fast_greedy=True, batch_size=bs)
        greedy = [p.is_greedy for p in params]
        bias = (logit_bias or LogitBias()).tensors(params, vocab_size, device)

        info = cls(fast_greedy=False, batch_size=bs, greedy=greedy, generators=list(generators),
                   min_token_mask=min_mask or None)
        if bias is not None:
            info.bias_index, info.bias_values = bias

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)[:, None]

        info.temperatures = col([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
            info.top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]).to(device)
        if any(p.top_p < 1.0 for p in params):
            info.top_ps = col([p.top_p for p in params])[:, 0]
        if any(p.min_p > 0.0 for p in params):
            info.min_ps = col([p.min_p for p in params])[:, 0]
        if any(p.repetition_penalty != 1.0 for p in params):
            info.rep_penalties = col([p.repetition_penalty for p in params])
            mask = torch.zeros(bs, vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.repetition_penalty != 1.0:
                    mask[i, torch.tensor(prompt_ids[i] + output_ids[i], dtype=torch.int64)] = True
            info.rep_mask = mask.to(device)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            info.freq_penalties = col([p.frequency_penalty for p in params])
            info.pres_penalties = col([p.presence_penalty for p in params])
            counts = torch.zeros(bs, vocab_size, dtype=torch.float32)
            for i, out in enumerate(output_ids):
                if out:
                    counts[i].index_add_(0, torch.tensor(out, dtype=torch.int64), torch.ones(len(out)))
            info.counts = counts.to(device)
        return info


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """logits: [B, V] float32. Penalties, logit_bias, then the min_new_tokens mask. The penalties make a
    new tensor; logit_bias is added in place (into logits itself when there are no penalties): a
    copy of the whole [B, V] for a few entries would make every row pay for the biased ones."""
    raw = logits
    if info.rep_penalties is not None:
        assert info.rep_mask is not None  # built together with rep_penalties
        penalized = torch.where(logits > 0, logits / info.rep_penalties, logits * info.rep_penalties)
        logits = torch.where(info.rep_mask, penalized, logits)
    if info.counts is not None:
        assert info.freq_penalties is not None and info.pres_penalties is not None  # built together with counts
        logits = logits - (info.freq_penalties * info.counts + info.pres_penalties * (info.counts > 0).float())
    if info.bias_index is not None:
        assert info.bias_values is not None  # built together with bias_index
        logits = logits.contiguous()  # a no-op for the model's logits; the flat view below needs it
        logits.view(-1).index_add_(0, info.bias_index, info.bias_values)  # [B * V] view of [B, V]
    if info.min_token_mask:
        if logits is raw:
            logits = logits.clone()
        for row, ids in info.min_token_mask:
            logits[row, ids] = float("-inf")
    return logits


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> torch.Tensor:
    """probs [R, V] float32 after temperature -> unnormalized probs with top_k/top_p/min_p cut to 0."""
    top_ks = info.top_ks[rows] if info.top_ks is not None else None
    top_ps = info.top_ps[rows] if info.top_ps is not None else None
    if top_ks is None and top_ps is None:
        if info.min_ps is not None:
            probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * info.min_ps[rows, None], 0.0)
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_ps is not None:
        # Keep the smallest head whose mass reaches top_p: drop a token once the mass before it does.
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) > top_ps[:, None]
    if top_ks is not None:
        drop |= torch.arange(probs.shape[-1], device=probs.device)[None, :] >= top_ks[:, None]
    if info.min_ps is not None:
        drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps[rows, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of probs [R, V]; seeded rows use their own generator, the rest one batched call."""
    out = [0] * probs.shape[0]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        picked = torch.multinomial(probs[unseeded], 1)[:, 0].tolist() if len(unseeded) < len(out) \
            else torch.multinomial(probs, 1)[:, 0].tolist()
        for i, t in zip(unseeded, picked):
            out[i] = t
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = int(torch.multinomial(probs[i], 1, generator=g))
    return out


# The model's logits are inference tensors (the runner runs under inference_mode): the in-place
# logit_bias add is only allowed on them inside it, and nothing here needs autograd anyway.
@torch.inference_mode()
def sample(logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: list[bool],
           top_logprobs_num: list[int], argmax: Callable[[torch.Tensor], list[int]] | None = None) -> SampleOutput:
    """logits: [B, V] float32 raw model output, the caller's to spend: logit_bias is added into it in
    place (the logprobs are taken first); or, for a fast_greedy batch that wants no logprobs, [B] int64
    argmax ids already taken by the forward (ForwardBatch.greedy). argmax: a faster
    torch.argmax(logits, -1).tolist() (the C kernel's, on CPU), for an all-greedy batch."""
    bs = logits.shape[0]
    if logits.dim() == 1:
        assert info.fast_greedy and not any(return_logprob) and not any(top_logprobs_num)
        return SampleOutput(logits.tolist(), [None] * bs, [None] * bs)
    want = [i for i in range(bs) if return_logprob[i] or top_logprobs_num[i] > 0]
    # [W, V] log-probabilities of the raw logits, before anything below edits them.
    lp = torch.log_softmax(logits[want].float(), dim=-1) if want else None
    if info.fast_greedy:
        next_ids = argmax(logits) if argmax is not None else logits.argmax(-1).tolist()
    else:
        next_ids = [0] * bs
        # build() sets these on every batch that is not fast_greedy
        assert info.greedy is not None and info.temperatures is not None and info.generators is not None
        logits_p = apply_penalties(logits, info)
        greedy_rows = [i for i in range(bs) if info.greedy[i]]
        if greedy_rows:
            for i, t in zip(greedy_rows, logits_p[greedy_rows].argmax(-1).tolist()):
                next_ids[i] = t
        rand_rows = [i for i in range(bs) if not info.greedy[i]]
        if rand_rows:
            rows = torch.tensor(rand_rows, device=logits.device)
            probs = torch.softmax(logits_p[rows] / info.temperatures[rows], dim=-1)  # [R, V]
            probs = filter_probs(probs, info, rows)
            for i, t in zip(rand_rows, draw(probs, [info.generators[i] for i in rand_rows])):
                next_ids[i] = t
    logprobs: list[float | None] = [None] * bs
    tops: list[list[tuple[int, float]] | None] = [None] * bs
    if lp is not None:
        chosen = lp.gather(1, torch.tensor([next_ids[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
        k = max(top_logprobs_num[i] for i in want)
        top_v, top_i = (lp.topk(k, dim=-1) if k > 0 else (None, None))
        for j, i in enumerate(want):
            if return_logprob[i]:
                logprobs[i] = chosen[j]
            n = top_logprobs_num[i]
            if n > 0:
                assert top_i is not None and top_v is not None  # n > 0 implies k > 0
                tops[i] = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
    return SampleOutput(next_ids, logprobs, tops)
