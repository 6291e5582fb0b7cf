"""The scheduler's side of constrained decoding: park requests while their grammar compiles, mask
logits before sampling, advance each matcher after it.

A constrained request does not enter `waiting` until its matcher is ready, so it holds no KV while
it waits and a slow compile never blocks the requests behind it. The scheduler calls:
`submit` at intake, `poll` at the start of each step, `mask` between forward and sampling,
`accept` after appending each token, and `abort` with its own predicate. Single-threaded (the
scheduler thread); only the queue's compile workers run elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import torch

from ringserve.message import Finish
from services.scheduler.core.req import Req
from services.scheduler.grammar import GrammarMasker, GrammarQueue, GrammarQueueFull, constraint_of, field_of
from services.scheduler.memory import MemoryItem


class GrammarGlue:
    def __init__(self, queue: GrammarQueue | None, masker: GrammarMasker | None) -> None:
        """queue / masker: None when constrained decoding is disabled (--grammar-backend none, or
        the backend's package is missing); constrained requests are then refused."""
        self.queue = queue
        self.masker = masker
        self.reqs: dict[str, Req] = {}   # rid -> request whose grammar is compiling (the "grammar_reqs")

    def memory_item(self) -> MemoryItem:
        """The compiled grammars cached and the mask buffer, against their bounds (memory.py)."""
        if self.queue is None or self.masker is None:
            return MemoryItem("grammar", 0, 0, "--grammar-backend none")
        cache, mask = self.queue.cache, self.masker.bitmask.nbytes  # host bytes (a CUDA copy is on the device)
        return MemoryItem("grammar", cache.bytes + mask, cache.max_bytes + mask,
                          "--grammar-cache-mib, --max-running-requests")

    @staticmethod
    def is_constrained(req: Req) -> bool:
        return constraint_of(req.params) is not None

    # -- intake and readiness ----------------------------------------------------------------------

    def submit(self, req: Req) -> Finish | None:
        """Park a constrained request until its grammar is ready; the abort reason if refused."""
        constraint = constraint_of(req.params)
        assert constraint is not None
        kind, text = constraint
        if self.queue is None:
            return Finish.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"{field_of(kind)}: constrained decoding is disabled")
        try:
            self.queue.submit(req.rid, kind, text)
        except GrammarQueueFull as e:
            if self.queue.metrics is not None:
                self.queue.metrics.count_error("full")
            return Finish.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.reqs[req.rid] = req
        return None

    def poll(self) -> list[tuple[Req, Finish | None]]:
        """Requests whose grammar resolved, in submit order: (req, None) now carries its matcher and
        may be scheduled; (req, reason) must be finished with that abort (it holds no KV)."""
        if self.queue is None or not self.reqs:
            return []
        out: list[tuple[Req, Finish | None]] = []
        for ready in self.queue.poll():
            req = self.reqs.pop(ready.rid, None)
            if req is None:  # aborted meanwhile (cancel already forgot it); be total anyway
                continue
            if ready.error is not None:
                out.append((req, Finish.abort(ready.status, ready.error or "")))
            else:
                req.grammar = ready.matcher
                out.append((req, None))
        return out

    def has_ready(self) -> bool:
        """A poll would hand something back. Not `bool(self.reqs)`: the loop would busy-spin on
        requests that are only compiling (the queue's on_ready wakes it instead)."""
        return self.queue is not None and bool(self.reqs) and self.queue.has_ready()

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest compile timeout (an idle loop must wake by then)."""
        return self.queue.next_deadline_s() if self.queue is not None and self.reqs else None

    def abort(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [r for r in self.reqs.values() if pred(r)]
        for r in gone:
            del self.reqs[r.rid]
            if self.queue is not None:
                self.queue.cancel(r.rid)
        return gone

    def __len__(self) -> int:
        return len(self.reqs)

    # -- around sampling ---------------------------------------------------------------------------

    def mask(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """logits: [B, V] float, one row per req (modified in place); unconstrained rows untouched."""
        if self.masker is not None and any(r.grammar is not None for r in reqs):
            self.masker.apply(logits, [r.grammar for r in reqs])

    @staticmethod
    def accept(req: Req, token: int) -> Finish | None:
        """Advance req's matcher by its newest token; the finish it implies, if any."""
        m = req.grammar
        if m is None:
            return None
        if not m.accept_token(token):  # the mask let through a token the grammar refuses: a bug
            return Finish.abort(grpc.StatusCode.INTERNAL,
                                f"internal error: token {token} violates the request's grammar")
        if m.is_terminated():  # complete output and an EOS accepted (even with ignore_eos)
            return Finish("stop", matched_token=token)
        return None
