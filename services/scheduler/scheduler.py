"""The scheduling loop: waiting queue -> (chunked) prefill -> running batch -> decode, one step at a time.

`step()` is the whole loop body: schedule a prefill within the budgets (the running requests decode
in it with mixed_chunk, mixed.py), else decode every running request (retracting some if the KV pool
is short); run the forward; sample; append tokens, decide finishes, release KV; return what to emit.
With decode_interleave a decode step follows every prefill step while requests run, so a burst of
prompts does not stall them for the whole burst, and each chunk's requests start decoding (and later
finish) at once instead of all together: their successors then arrive spread out, not as another burst.
Constrained requests (json_schema / regex / ebnf) join `waiting` only once their grammar compiled
(grammar_glue.py); their logits rows are masked before sampling. Not thread-safe: the Engine
serializes calls.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from services.scheduler import prompt_logprobs
from services.scheduler.decode import build_decode_batch
from services.scheduler.finish import FinishChecker
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.grammar_glue import GrammarGlue
from services.scheduler.kv_manager import KVManager
from services.scheduler.mixed import mix
from services.scheduler.outputs import ReqOutput, make_output
from services.scheduler.prefill import build_extend_batch
from services.scheduler.req import FinishInfo, Req
from services.scheduler.retract import retract_for_decode
from services.scheduler.sample_reqs import sample_reqs
from services.scheduler.sampling import make_generator
from services.scheduler.schedule_policy import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    PrefillAdder,
    order_waiting,
)
from services.scheduler.stats import SchedulerStats

RECENT_FINISHED_S = 60.0
RECENT_FINISHED_MAX = 4096


@dataclass
class Batch:
    reqs: list[Req]
    forward: ForwardBatch
    sample_rows: list[int]     # rows whose logits yield a token (not a mid-prompt chunk)
    is_prefill: bool
    num_decode: int = 0        # a mixed step: the last num_decode reqs are the running batch, decoding


class Scheduler:
    def __init__(self, runner, kv: KVManager, finisher: FinishChecker, *, schedule_policy: str,
                 max_running_requests: int, max_prefill_tokens: int, chunked_prefill_size: int,
                 stream_interval: int = 1, grammar: GrammarGlue | None = None, mixed_chunk: bool = False,
                 decode_interleave: bool = True) -> None:
        self.runner = runner
        self.kv = kv
        self.finisher = finisher
        self.policy = schedule_policy
        self.max_running = min(max_running_requests, kv.req_pool.size)
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.stream_interval = stream_interval
        self.mixed_chunk = mixed_chunk
        self.decode_interleave = decode_interleave and not mixed_chunk  # mixed: they decode in the prefill
        self._decode_next = False   # the last step was a prefill: the running requests' turn
        self.device = runner.device
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None   # mid-prefill; continues first in the next prefill
        # Constrained requests wait in the grammar queue, not in waiting, until their matcher is ready.
        self.grammar = grammar if grammar is not None else GrammarGlue(None, None)
        self.recent: deque[tuple[float, Req]] = deque(maxlen=RECENT_FINISHED_MAX)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._emit: list[ReqOutput] = []

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        for req, failed in self.grammar.poll():  # grammars that compiled (or failed) since the last step
            if failed is not None:
                self.finish(req, failed)
            else:
                self.waiting.append(req)
        first, then = ((self.schedule_decode, self.schedule_prefill) if self._decode_next and self.running
                       else (self.schedule_prefill, self.schedule_decode))
        batch = first() or then()
        self._decode_next = self.decode_interleave and batch is not None and batch.is_prefill
        if batch is not None:
            t0 = time.monotonic()
            logits = prompt_logprobs.take(batch.reqs, batch.forward, self.runner.forward(batch.forward))  # [B, V]
            next_ids = self.sample(batch, logits)
            self.process_results(batch, next_ids, time.monotonic() - t0)
        out, self._emit = self._emit, []
        return out

    # -- scheduling ----------------------------------------------------------------------------

    def schedule_prefill(self) -> Batch | None:
        if not self.waiting and self.chunked is None:
            return None
        order_waiting(self.waiting, self.policy, self.kv)
        adder = PrefillAdder(self.kv, self.running, self.max_prefill_tokens, self.chunked_prefill_size,
                             self.max_running, self.new_token_ratio, self.runner.vocab_size)
        if self.chunked is not None:
            req = self.chunked
            if adder.add(req) != "chunked" and adder.reqs and adder.reqs[-1] is req:
                self.chunked = None  # its last chunk runs now; it joins the running batch after
        deferred: list[Req] = []  # they share a prefix with one admitted now: next step, from the cache
        while self.chunked is None and self.waiting:
            req = self.waiting[0]
            res = adder.add(req)
            if res == "defer":
                deferred.append(self.waiting.popleft())
                continue
            if res == "stop" and (not adder.reqs or adder.reqs[-1] is not req):
                break
            self.waiting.popleft()
            if res == "chunked":
                self.chunked = req
                break
            if res == "stop":
                break
        self.waiting.extendleft(reversed(deferred))
        if not adder.reqs:
            return None
        now = time.monotonic()
        for req in adder.reqs:
            if not req.timings.first_scheduled:  # first prefill: count what the cache saved it
                req.timings.first_scheduled = now
                req.cached_tokens = req.kv_len
                self.stats.prompt_tokens += len(req.origin_input_ids)
                self.stats.cached_prompt_tokens += req.kv_len
        fb = build_extend_batch(adder.reqs, adder.extend_lens, adder.slots,
                                self.kv.req_pool.req_to_token, self.device)
        fb.logit_rows = prompt_logprobs.logit_rows(adder.reqs, adder.extend_lens)
        rows = [i for i, (r, n) in enumerate(zip(adder.reqs, adder.extend_lens)) if r.kv_len + n == len(r.fill_ids)]
        self.stats.prefill_tokens += sum(adder.extend_lens)
        self.stats.prefill_steps += 1
        batch = Batch(adder.reqs, fb, rows, is_prefill=True)
        return self._with_running(batch) if self.mixed_chunk and self.running else batch

    def _with_running(self, batch: Batch) -> Batch:
        """The running requests decode in the prefill's forward pass (mixed.py), when the pool has room."""
        slots = self.kv.alloc(len(self.running))
        if slots is None:
            return batch  # the next decode step retracts as usual
        dec = build_decode_batch(self.running, slots, self.kv.req_pool.req_to_token, self.device)
        self.stats.mixed_steps += 1
        rows = batch.sample_rows + list(range(len(batch.reqs), len(batch.reqs) + len(self.running)))
        return Batch(batch.reqs + self.running, mix(batch.forward, dec), rows, True, len(self.running))

    def schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        self.running, retracted = retract_for_decode(self.running, self.kv)
        if retracted:
            self.stats.retractions += len(retracted)
            self.waiting.extendleft(reversed(retracted))  # first in line, in their running order
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        slots = self.kv.alloc(len(self.running))
        if slots is None and self.chunked is not None:
            # The mid-prefill request holds the last free KV: send it back to recompute later.
            self._requeue_chunked()
            slots = self.kv.alloc(len(self.running))
        if slots is None:  # one request alone outgrew the pool: end it rather than loop forever
            req = self.running.pop()
            self.finish(req, FinishInfo("length"))
            return self.schedule_decode()
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.stats.decode_steps += 1
        fb = build_decode_batch(self.running, slots, self.kv.req_pool.req_to_token, self.device)
        return Batch(list(self.running), fb, list(range(len(self.running))), is_prefill=False)

    def _requeue_chunked(self) -> None:
        req, self.chunked = self.chunked, None
        self.kv.release(req, cache=True)
        req.reset_for_recompute()
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    # -- sampling and results ------------------------------------------------------------------

    def sample(self, batch: Batch, logits: torch.Tensor) -> list[int]:
        rows = batch.sample_rows
        if len(rows) != len(batch.reqs):
            logits = logits[rows]
        return sample_reqs([batch.reqs[i] for i in rows], logits, self.grammar, self.finisher,
                           self.runner.vocab_size, self.device, self.runner.argmax)

    def process_results(self, batch: Batch, next_ids: list[int], elapsed: float) -> None:
        now = time.monotonic()
        if batch.is_prefill:
            prefilled = len(batch.reqs) - batch.num_decode
            for req, n in zip(batch.reqs[:prefilled], batch.forward.extend_lens):
                req.kv_len += n
                req.timings.prefill_s += elapsed
                self.kv.cache_prefix(req)
            for req in batch.reqs[prefilled:]:  # a mixed step's decode rows
                req.kv_len += 1
            still_running = [] if batch.num_decode else self.running  # mixed: all re-added below
            self.stats.prefill_s += elapsed
        else:
            for req in batch.reqs:
                req.kv_len += 1
            still_running = []
            self.stats.decode_s += elapsed
            self.stats.decode_rows += len(batch.reqs)
        for row, token in zip(batch.sample_rows, next_ids):
            req = batch.reqs[row]
            if req.params.max_new_tokens == 0:  # a prompt scored, nothing generated (SGLang, OpenAI echo)
                self.finish(req, FinishInfo("length"))
                continue
            req.output_ids.append(token)
            req.timings.last_token = now
            reason = self.grammar.accept(req, token) or self.finisher.check(req)
            if reason is not None:
                self.finish(req, reason)
                continue
            still_running.append(req)
            # Every stream_interval tokens; the first token at once (TTFT), the finish above.
            unsent = len(req.output_ids) - req.sent_offset
            if req.stream and (req.sent_offset == 0 or unsent >= self.stream_interval):
                self._emit.append(make_output(req))
        self.stats.generated_tokens += len(next_ids)
        self.running = still_running

    def finish(self, req: Req, reason: FinishInfo, cache: bool = True) -> None:
        req.finished_reason = reason
        req.grammar = None
        self.kv.release(req, cache=cache)
        self.stats.finished += 1
        self.recent.append((time.monotonic(), req))
        self._emit.append(make_output(req, full=not req.stream))

    # -- intake, aborts, resync ------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        if req.params.seed is not None:
            req.generator = make_generator(req.params.seed, self.device)
        prompt_logprobs.seed(req)
        limit = min(self.finisher.max_seq_len, self.kv.size)
        if not req.origin_input_ids or len(req.origin_input_ids) >= limit:
            self._refuse(req, FinishInfo("abort", message=f"prompt has {len(req.origin_input_ids)} tokens; it must "
                                                          f"have 1 to {limit - 1}", status_code=3))  # INVALID_ARGUMENT
        elif self.grammar.is_constrained(req):
            refused = self.grammar.submit(req)  # joins waiting once its grammar compiled
            if refused is not None:
                self._refuse(req, refused)
        else:
            self.waiting.append(req)

    def _refuse(self, req: Req, reason: FinishInfo) -> None:
        req.finished_reason = reason
        self.recent.append((time.monotonic(), req))
        self._emit.append(make_output(req, full=True))

    def abort(self, pred) -> list[Req]:
        """Remove every request for which pred(req) is true; free its KV now. No output is emitted."""
        gone = self.grammar.abort(pred)
        gone += [r for r in self.waiting if pred(r)]
        if gone:
            self.waiting = deque(r for r in self.waiting if not pred(r))
        if self.chunked is not None and pred(self.chunked):
            gone.append(self.chunked)
            self.kv.release(self.chunked, cache=False)
            self.chunked = None
        keep = []
        for r in self.running:
            if pred(r):
                gone.append(r)
                self.kv.release(r, cache=False)
            else:
                keep.append(r)
        self.running = keep
        for r in gone:
            r.finished_reason = FinishInfo("abort", message="aborted")
            r.grammar = None
        return gone

    def live_reqs(self) -> list[Req]:
        chunk = [self.chunked] if self.chunked is not None else []
        return [*self.running, *chunk, *self.waiting, *self.grammar.reqs.values()]

    def recent_finished(self) -> list[Req]:
        cutoff = time.monotonic() - RECENT_FINISHED_S
        while self.recent and self.recent[0][0] < cutoff:
            self.recent.popleft()
        return [r for _, r in self.recent]

    def has_work(self) -> bool:
        """A step now would do something (requests only compiling their grammar do not count)."""
        return bool(self.running or self.waiting or self.chunked or self._emit) or self.grammar.has_ready()

    def num_queued(self) -> int:
        """Requests not yet running: waiting plus compiling their grammar."""
        return len(self.waiting) + len(self.grammar)
