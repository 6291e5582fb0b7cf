"""Apply the grammar masks of one step's batch to its logits, in place, before sampling.

Only constrained rows are filled and masked (xgrammar's `indices`), so unconstrained requests in
the same batch pay nothing. The bitmask buffer is allocated once for the largest batch and reused
every step (grown if a bigger batch ever comes). Masked tokens get -inf, so every later sampling
stage (penalties, temperature, top-k/p, min-p, argmax) keeps them out; logprobs taken from these
logits are those of the constrained distribution, as in SGLang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.scheduler.grammar.backend import GrammarBackend, GrammarMatcher
from services.scheduler.grammar.metrics import GrammarMetrics


class GrammarMasker:
    def __init__(self, backend: GrammarBackend, max_batch_size: int, device: torch.device | str = "cpu",
                 metrics: GrammarMetrics | None = None) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.metrics = metrics
        self.last_seconds = 0.0
        self._alloc(max(1, max_batch_size))

    def _alloc(self, rows: int) -> None:
        on_gpu = self.device.type == "cuda"
        self.bitmask = self.backend.allocate_bitmask(rows, pin_memory=on_gpu)  # [rows, ceil(V/32)] int32 CPU
        # The kernel reads the mask on the logits' device; one buffer there, copied into each step.
        self.device_bitmask = self.bitmask.to(self.device) if on_gpu else self.bitmask

    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> int:
        """logits: [B, V] float (modified in place); matchers: B entries, None = unconstrained row.
        Returns how many rows were masked."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return 0
        t0 = time.perf_counter()
        if len(matchers) > self.bitmask.shape[0]:
            self._alloc(len(matchers))
        active = [matchers[i] for i in rows]
        self.backend.fill_bitmasks(active, self.bitmask, rows)  # type: ignore[arg-type]
        mask = self.bitmask
        if self.device_bitmask is not self.bitmask:
            n = len(matchers)
            self.device_bitmask[:n].copy_(self.bitmask[:n], non_blocking=True)
            mask = self.device_bitmask
        self.backend.apply_bitmask(logits, mask, rows)
        self.last_seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.mask_seconds.observe(self.last_seconds)
        return len(rows)
