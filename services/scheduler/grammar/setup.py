"""Building the engine's constrained-decoding parts: backend, grammar queue and masker.

`import xgrammar` takes seconds (about 12 s with a cold disk cache), so the engine starts that import
on a thread before it loads the model and only waits for it afterwards. The tokenizer, detokenizer
and gateway never import it: only this module (in the scheduler process) does.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable

from services.scheduler.config import EngineConfig
from services.scheduler.grammar import GrammarCache, GrammarMasker, GrammarMetrics, GrammarQueue, load_backend
from services.scheduler.grammar.glue import GrammarGlue

log = logging.getLogger(__name__)

_BACKEND_MODULES = {"xgrammar": "services.scheduler.grammar.xgrammar_backend"}


class GrammarPrefetch:
    """The backend's import, running on a daemon thread; `join` waits for it (errors surface later,
    when load_backend imports the module again in the caller's thread)."""

    def __init__(self, thread: threading.Thread | None) -> None:
        self._thread = thread

    @classmethod
    def start(cls, backend: str) -> GrammarPrefetch:
        module = _BACKEND_MODULES.get(backend)
        if module is None:
            return cls(None)
        t = threading.Thread(target=_try_import, args=(module,), name="grammar-import", daemon=True)
        t.start()
        return cls(t)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def _try_import(module: str) -> None:
    t0 = time.monotonic()
    try:
        importlib.import_module(module)
    except Exception:  # reported by build_grammar, which imports it again
        return
    log.info("grammar backend module imported in %.1fs (during model load)", time.monotonic() - t0)


def build_grammar(cfg: EngineConfig, runner, prefetch: GrammarPrefetch, on_ready: Callable[[], None],
                  metrics: GrammarMetrics | None = None) -> GrammarGlue:
    """runner: the ModelRunner (vocab_size = logits width, eos_token_ids, device). A missing backend
    package is logged, not fatal: the server still serves unconstrained requests."""
    prefetch.join()
    t0 = time.monotonic()
    try:
        backend = load_backend(cfg.grammar_backend, cfg.model, runner.vocab_size, runner.eos_token_ids)
    except ImportError as e:
        log.error("grammar backend %s unavailable (%s); constrained requests will be refused",
                  cfg.grammar_backend, e)
        backend = None
    if backend is None:
        log.info("constrained decoding disabled")
        return GrammarGlue(None, None)
    log.info("grammar backend %s ready in %.1fs", backend.name, time.monotonic() - t0)
    cache = GrammarCache(cfg.grammar_cache_size, cfg.grammar_cache_mib << 20)
    queue = GrammarQueue(backend, cache, timeout_s=cfg.grammar_compile_timeout_s,
                         max_size=cfg.max_queued_requests, on_ready=on_ready, metrics=metrics)
    masker = GrammarMasker(backend, cfg.max_running_requests, runner.device, metrics)
    return GrammarGlue(queue, masker)
