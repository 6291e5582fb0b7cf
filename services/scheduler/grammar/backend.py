"""The grammar backend interface: compile a constraint once, match many requests against it.

Rules every backend keeps:
- `compile` is pure and thread-safe (the grammar queue calls it from worker threads); an invalid
  schema / pattern / grammar raises `GrammarError` naming the request field, never anything else
  the caller has to know about.
- A `CompiledGrammar` is immutable and shared: every request (every sample of an n > 1 request)
  gets its own `GrammarMatcher` from it.
- A matcher is used by the scheduler thread only. After `accept_token(eos)` on a complete output
  it is terminated and accepts nothing more.
- Bitmasks are int32 [rows, ceil(V / 32)] on CPU: bit j of row i set = token j allowed (the
  xgrammar / llguidance layout, so a second backend can share `masking.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal, get_args

import torch

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = get_args(GrammarKind)


def field_of(kind: GrammarKind) -> str:
    """The request field a constraint came from, as the tokenizer names fields in its errors."""
    return f"sampling_params.{kind}"


class GrammarError(ValueError):
    """A constraint that cannot be compiled. str() is `"<field>: <message>"`, the project's 400 shape."""

    def __init__(self, field: str, message: str, internal: bool = False) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.internal = internal  # a backend failure, not the client's constraint: never cached


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bitmask: [R, ceil(V/32)] int32, CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""

    def memory_bytes(self) -> int:
        """Bytes the compiled grammar holds (the grammar cache's byte bound counts them); 0 where the
        backend cannot tell."""
        return 0


class GrammarBackend(ABC):
    """Compiles constraints for one model's vocabulary and applies their masks to logits."""

    name: str = "base"
    vocab_size: int  # the logits width V (the model's, which may exceed the tokenizer's)

    @abstractmethod
    def compile(self, kind: GrammarKind, text: str) -> CompiledGrammar:
        """Raises GrammarError(field_of(kind), why) for an invalid constraint."""

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        """[rows, ceil(V/32)] int32 on CPU, all tokens allowed. Pinned when it is copied to a GPU."""
        mask = torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        return mask.pin_memory() if pin_memory else mask

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """bitmask[rows[i]] <- matchers[i]'s mask. Backends may override with a batched call."""
        for m, row in zip(matchers, rows):
            m.fill_bitmask(bitmask, row)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """logits[r, j] = -inf where bit j of bitmask[r] is 0, for r in rows. logits: [B, V] (any
        device, bitmask on the same one); the portable reference, backends override with a kernel."""
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        v = logits.shape[-1]
        bits = torch.arange(32, device=logits.device, dtype=torch.int32)
        words = bitmask[idx]                                              # [R, W] int32
        allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, :v]  # [R, W*32] -> [R, V]
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
