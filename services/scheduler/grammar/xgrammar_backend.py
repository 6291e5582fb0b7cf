"""The xgrammar (0.2.x) backend: JSON schema, regex and EBNF (GBNF dialect) on one compiler.

xgrammar is imported here only, so the rest of the package (and the scheduler) loads without it.
Its compiler releases the GIL while compiling, so worker threads do not stall the scheduler loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import xgrammar as xgr

from services.scheduler.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    field_of,
)

# xgrammar's C++ errors start with "[12:01:33] /project/cpp/regex_converter.cc:94: " and may add a
# failed check's text; neither means anything to a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_MAX_MESSAGE = 300  # error messages echo the schema; keep them readable in an HTTP 400


def _clean(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", text))
    text = text.split(" The JSON string is:")[0]
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher) -> None:
        self.m = m

    def accept_token(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def reset(self) -> None:
        self.m.reset()


class XCompiledGrammar(CompiledGrammar):
    __slots__ = ("compiled",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled))

    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class XGrammarBackend(GrammarBackend):
    """any_whitespace=False (default) makes JSON compact and canonical (", " and ": " separators):
    free whitespace lets small models loop on newlines until max_new_tokens. strict_mode (default
    True, as SGLang) forbids properties and items the schema does not name."""

    name = "xgrammar"

    def __init__(self, info: xgr.TokenizerInfo, *, any_whitespace: bool = False, strict_mode: bool = True,
                 compile_threads: int = 2, fill_threads: int = 1) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.any_whitespace = any_whitespace
        self.strict_mode = strict_mode
        # Our GrammarCache bounds memory by entries; xgrammar's own cache would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=compile_threads, cache_enabled=False)
        # Fills the masks of a batch on fill_threads C++ threads; 1 = in the calling thread.
        self._batch = xgr.BatchGrammarMatcher(fill_threads) if fill_threads > 1 else None

    @classmethod
    def from_model(cls, model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int],
                   **kwargs) -> XGrammarBackend:
        """vocab_size: the model's logits width (config.vocab_size), which may exceed the tokenizer's;
        stop_token_ids: the model's EOS ids, the only tokens a complete grammar allows next."""
        from transformers import AutoTokenizer  # the scheduler has transformers; import on use

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        return cls(info, **kwargs)

    def compile(self, kind: GrammarKind, text: str) -> XCompiledGrammar:
        field = field_of(kind)
        try:
            if kind == "json_schema":
                try:
                    json.loads(text)  # a clearer message than the C++ parser's for plain bad JSON
                except ValueError as e:
                    raise GrammarError(field, f"not valid JSON: {e}") from None
                compiled = self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace,
                                                             strict_mode=self.strict_mode)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = self.compiler.compile_grammar(text)
            else:
                raise GrammarError("sampling_params", f"unknown constraint kind {kind!r}")
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports every parse error so
            raise GrammarError(field, _clean(e)) from None
        return XCompiledGrammar(compiled)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if self._batch is None or len(matchers) < 2:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        self._batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, rows)  # type: ignore[attr-defined]

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # CPU: xgrammar's C++ kernel; CUDA: its Triton kernel (bitmask must be on the logits' device).
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
