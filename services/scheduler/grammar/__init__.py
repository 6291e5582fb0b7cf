"""Constrained decoding (json_schema / regex / ebnf) for the scheduler.

    backend = load_backend("xgrammar", model_dir, runner.vocab_size, runner.eos_token_ids)
    queue = GrammarQueue(backend, GrammarCache(), timeout_s=..., on_ready=engine.wake)
    masker = GrammarMasker(backend, max_running_requests, device)

A request with a constraint goes to `queue.submit(rid, kind, text)` instead of `waiting`; each
step `queue.poll()` hands back its own matcher (or an error that aborts it). Before sampling,
`masker.apply(logits, [req.grammar for req in reqs])`; after it, `req.grammar.accept_token(tok)`.

Importing this package does not import xgrammar (which takes seconds): only load_backend does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.scheduler.grammar.backend import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    field_of,
)
from services.scheduler.grammar.grammar_cache import GrammarCache
from services.scheduler.grammar.grammar_queue import GrammarQueue, GrammarQueueFull, GrammarReady
from services.scheduler.grammar.masking import GrammarMasker
from services.scheduler.grammar.metrics import GrammarMetrics

BACKENDS = ("xgrammar", "none")

__all__ = ["BACKENDS", "GRAMMAR_KINDS", "CompiledGrammar", "GrammarBackend", "GrammarCache", "GrammarError",
           "GrammarKind", "GrammarMasker", "GrammarMatcher", "GrammarMetrics", "GrammarQueue", "GrammarQueueFull",
           "GrammarReady", "constraint_of", "field_of", "load_backend"]


def constraint_of(params: Any) -> tuple[GrammarKind, str] | None:
    """(kind, text) of the request's constraint, or None. params: anything with optional
    json_schema / regex / ebnf attributes (the scheduler's SamplingParams). The tokenizer has
    already rejected requests that set more than one."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return kind, text
    return None


def load_backend(name: str, model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int],
                 **kwargs: Any) -> GrammarBackend | None:
    """The named backend for this model, or None for "none" (constrained requests are then
    aborted with a clear message). Raises ImportError if the backend's package is missing."""
    if name == "none":
        return None
    if name == "xgrammar":
        from services.scheduler.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend.from_model(model_dir, vocab_size, stop_token_ids, **kwargs)
    raise ValueError(f"grammar_backend: {name!r} is not one of {', '.join(BACKENDS)}")
