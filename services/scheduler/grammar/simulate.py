"""A decode loop without a model: random logits, the grammar mask, a draw, accept_token.

It runs the same calls the scheduler makes each step, so the tests can check that masked sampling
only ever yields tokens the grammar accepts and ends in a string the constraint matches, and the
bench can time the mask on matchers in realistic (mid-output) states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.scheduler.grammar.backend import GrammarMatcher
from services.scheduler.grammar.masking import GrammarMasker


@dataclass
class SimRow:
    ids: list[int] = field(default_factory=list)
    terminated: bool = False   # the matcher accepted a stop token after a complete output
    rejected: int | None = None  # a sampled token the matcher refused (a masking bug), if any


def random_decode(masker: GrammarMasker, matchers: Sequence[GrammarMatcher | None], max_steps: int,
                  generator: torch.Generator, temperature: float = 1.0, apply_mask: bool = True) -> list[SimRow]:
    """Decode every row until its matcher terminates (or refuses a token) or max_steps.
    matchers: None rows are unconstrained. apply_mask=False samples without the mask (to show
    the checks catch it)."""
    vocab = masker.backend.vocab_size
    rows = [SimRow() for _ in matchers]
    live = [i for i in range(len(matchers))]
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=generator) / temperature  # [B, V] float32
        if apply_mask:
            masker.apply(logits, [matchers[i] for i in live])
        probs = torch.softmax(logits, dim=-1)
        picked = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()  # [B]
        still = []
        for i, tok in zip(live, picked):
            row, m = rows[i], matchers[i]
            row.ids.append(tok)
            if m is not None:
                if not m.accept_token(tok):
                    row.rejected = tok
                    continue
                if m.is_terminated():
                    row.terminated = True
                    continue
            still.append(i)
        live = still
    return rows
