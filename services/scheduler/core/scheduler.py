"""The scheduling core: waiting queue -> (chunked) prefill -> running batch -> decode, and what each
step's tokens do to the requests.

The Engine calls, once per step: `add_request` / `abort` (what the inbox held), `schedule` (a prefill
within the budgets, the running requests decoding in it with mixed_chunk; else decode every running
request, retracting some if the KV pool is short), `sample` and `process_results` (append tokens,
decide finishes, release KV), and `take_outputs`. With decode_interleave a decode step follows every
prefill step while requests run, so a burst of prompts does not stall them for the whole burst, and
each chunk's requests start decoding (and later finish) at once instead of all together.
Constrained requests (json_schema / regex / ebnf) join `waiting` only once their grammar compiled
(grammar/glue.py); their logits rows are masked before sampling. Not thread-safe: the Engine
serializes calls.

Containers and statuses: `grammar` (GRAMMAR) -> `waiting` (WAITING) -> `chunked` (PREFILL, at most one)
-> `running` (RUNNING) -> FINISHED; a retraction sends a running request back to `waiting`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from ringserve.message import Finish, TokenDelta
from services.scheduler.core import prompt_logprobs
from services.scheduler.core.decode import RunningBatch
from services.scheduler.core.finish import FinishChecker
from services.scheduler.core.outputs import make_output
from services.scheduler.core.prefill import (
    NewTokenRatio,
    PrefillAdder,
    order_waiting,
)
from services.scheduler.core.req import Req, ReqStatus
from services.scheduler.grammar.glue import GrammarGlue
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.model_runner import ModelRunner
from services.scheduler.model_executor.sampling import (
    LogitBias,
    SampleOutput,
    SamplingBatchInfo,
    make_generator,
    sample,
)

RECENT_FINISHED_S = 60.0
RECENT_FINISHED_MAX = 4096


@dataclass
class SchedulerStats:
    """Counters since start (metrics, the benchmark's step profile, tests)."""

    prefill_tokens: int = 0        # tokens computed by prefill forwards (cached prefixes excluded)
    prompt_tokens: int = 0         # prompt tokens of requests at their first prefill
    cached_prompt_tokens: int = 0  # of which served from the radix cache
    generated_tokens: int = 0
    retractions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0           # prefill steps that also decoded the running batch
    finished: int = 0
    dropped_tokens: int = 0        # sampled for requests that had finished meanwhile (overlap's one-step lag)
    # The step profile: seconds in forward + sampling + results, and requests per decode step.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_rows: int = 0


@dataclass
class Batch:
    reqs: list[Req]
    forward: ForwardBatch
    sample_rows: list[int]     # rows whose logits yield a token (not a mid-prompt chunk)
    is_prefill: bool
    num_decode: int = 0        # a mixed step: the last num_decode reqs are the running batch, decoding
    # Set by `advance`: each prefilled request's KV length after this forward (what its results cache).
    kv_ends: list[int] | None = None


class Scheduler:
    def __init__(self, runner: ModelRunner, kv: KVManager, finisher: FinishChecker, *, schedule_policy: str,
                 max_running_requests: int, max_prefill_tokens: int, chunked_prefill_size: int,
                 stream_interval: int = 1, grammar: GrammarGlue | None = None, mixed_chunk: bool = False,
                 decode_interleave: bool = True, max_loras_per_batch: int = 0,
                 schedule_conservativeness: float = 1.0) -> None:
        self.runner = runner
        self.kv = kv
        self.finisher = finisher
        self.policy = schedule_policy
        self.max_running = min(max_running_requests, kv.req_pool.size)
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.stream_interval = stream_interval
        self.mixed_chunk = mixed_chunk
        self.max_loras_per_batch = max_loras_per_batch  # distinct adapters in running + prefill (0: no LoRA)
        self.decode_interleave = decode_interleave and not mixed_chunk  # mixed: they decode in the prefill
        self._decode_next = False   # the last step was a prefill: the running requests' turn
        self.device = runner.device
        self.waiting: deque[Req] = deque()
        self.running = RunningBatch()
        self.chunked: Req | None = None   # mid-prefill; continues first in the next prefill
        # Constrained requests wait in the grammar queue, not in waiting, until their matcher is ready.
        self.grammar = grammar if grammar is not None else GrammarGlue(None, None)
        self.recent: deque[tuple[float, Req]] = deque(maxlen=RECENT_FINISHED_MAX)
        self.ratio = NewTokenRatio.scaled(schedule_conservativeness)
        self.new_token_ratio = self.ratio.init
        self.stats = SchedulerStats()
        self._emit: list[TokenDelta] = []
        self.logit_bias = LogitBias()  # the batches' bias tensors, rebuilt only when their biased rows change
        # A weight update is draining: requests that have produced nothing yet stay in `waiting`
        # (they will run on the new weights); the rest finish on the old ones (core/control.py).
        self.hold_new = False
        self.weight_version = "default"  # stamped on each request at its prefill, for its outputs

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """This step's batch: a prefill, else a decode (decode first right after a prefill when
        interleaving); None when there is nothing to run."""
        for req, failed in self.grammar.poll():  # grammars that compiled (or failed) since the last step
            if failed is not None:
                self.finish(req, failed)
            else:
                self._wait(req)
        first, then = ((self.schedule_decode, self.schedule_prefill) if self._decode_next and self.running
                       else (self.schedule_prefill, self.schedule_decode))
        batch = first() or then()
        self._decode_next = self.decode_interleave and batch is not None and batch.is_prefill
        return batch

    def schedule_prefill(self) -> Batch | None:
        if not self.waiting and self.chunked is None:
            return None
        held: list[Req] = []
        if self.hold_new:
            held = [r for r in self.waiting if not r.output_ids]
            self.waiting = deque(r for r in self.waiting if r.output_ids)
        try:
            return self._schedule_prefill()
        finally:
            self.waiting.extend(held)

    def _schedule_prefill(self) -> Batch | None:
        if not self.waiting and self.chunked is None:
            return None
        order_waiting(self.waiting, self.policy, self.kv)
        adder = PrefillAdder(self.kv, self.running.reqs, self.max_prefill_tokens, self.chunked_prefill_size,
                             self.max_running, self.new_token_ratio, self.runner.vocab_size,
                             self.max_loras_per_batch)
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
            req.status = ReqStatus.PREFILL
            req.weight_version = self.weight_version
            if not req.timings.first_scheduled:  # first prefill: count what the cache saved it
                req.timings.first_scheduled = now
                req.cached_tokens = req.kv_len
                self.stats.prompt_tokens += len(req.origin_input_ids)
                self.stats.cached_prompt_tokens += req.kv_len
        fb = adder.forward_batch(self.kv.req_pool.req_to_token, self.device)
        fb.lora_ids = lora_ids(adder.reqs)
        rows = [i for i, (r, n) in enumerate(zip(adder.reqs, adder.extend_lens, strict=True))
                if r.kv_len + n == len(r.fill_ids)]
        self.stats.prefill_tokens += sum(adder.extend_lens)
        self.stats.prefill_steps += 1
        batch = Batch(adder.reqs, fb, rows, is_prefill=True)
        return self._with_running(batch) if self.mixed_chunk and self.running else batch

    def _with_running(self, batch: Batch) -> Batch:
        """The running requests decode in the prefill's forward pass (ForwardBatch.mix), when the pool has room."""
        slots = self.kv.alloc(len(self.running))
        if slots is None:
            return batch  # the next decode step retracts as usual
        dec = self.running.forward_batch(slots, self.kv.req_pool.req_to_token, self.device)
        dec.lora_ids = lora_ids(self.running.reqs)
        self.stats.mixed_steps += 1
        n = len(self.running)
        rows = batch.sample_rows + list(range(len(batch.reqs), len(batch.reqs) + n))
        return Batch(batch.reqs + self.running.reqs, ForwardBatch.mix(batch.forward, dec), rows, True, n)

    def schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        retracted = self.running.retract(self.kv)
        if retracted:
            self.stats.retractions += len(retracted)
            self.waiting.extendleft(reversed(retracted))  # first in line
            self.new_token_ratio = self.ratio.init
        slots = self.kv.alloc(len(self.running))
        if slots is None and self.chunked is not None:
            # The mid-prefill request holds the last free KV: send it back to recompute later.
            self._requeue_chunked()
            slots = self.kv.alloc(len(self.running))
        if slots is None:  # one request alone outgrew the pool: end it rather than loop forever
            req = self.running.reqs.pop()
            self.finish(req, Finish("length"))
            return self.schedule_decode()
        self.new_token_ratio = max(self.ratio.floor, self.new_token_ratio - self.ratio.decay)
        self.stats.decode_steps += 1
        fb = self.running.forward_batch(slots, self.kv.req_pool.req_to_token, self.device)
        fb.lora_ids = lora_ids(self.running.reqs)
        fb.greedy = argmax_only(self.running.reqs)
        return Batch(list(self.running.reqs), fb, list(range(len(self.running))), is_prefill=False)

    def _requeue_chunked(self) -> None:
        req, self.chunked = self.chunked, None
        assert req is not None
        self.kv.release(req, cache=True)
        req.reset_for_recompute()
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    # -- sampling and results ------------------------------------------------------------------

    def sample(self, batch: Batch, logits: torch.Tensor) -> list[int]:
        """logits: [len(batch.reqs) or the sampled rows, V] on the device. Each sampled row's next id."""
        rows = batch.sample_rows
        if len(rows) != len(batch.reqs):
            logits = logits[rows]
        return sample_reqs([batch.reqs[i] for i in rows], logits, self.grammar, self.finisher,
                           self.runner.vocab_size, self.device, self.runner.argmax, self.logit_bias)

    def process_results(self, batch: Batch, next_ids: list[int], elapsed: float) -> None:
        """A forward's sampled ids, right after it ran: `advance` then `apply_results`."""
        self.advance(batch)
        self.apply_results(batch, next_ids, elapsed)

    def advance(self, batch: Batch) -> None:
        """What a forward does to the requests' KV, known before it runs: their KV lengths grow, and
        the requests whose prompt is now complete join the running batch. Overlap scheduling calls
        this at launch, so the next step is scheduled on it while the forward runs (core/overlap.py)."""
        if batch.is_prefill:
            prefilled = len(batch.reqs) - batch.num_decode
            batch.kv_ends = []
            for req, n in zip(batch.reqs[:prefilled], batch.forward.extend_lens, strict=False):
                req.kv_len += n
                batch.kv_ends.append(req.kv_len)
            for req in batch.reqs[prefilled:]:  # a mixed step's decode rows
                req.kv_len += 1
            joining = [batch.reqs[row] for row in batch.sample_rows if row < prefilled]
            for req in joining:
                req.status = ReqStatus.RUNNING
            # A mixed step lists its prefills first: they stay first, as its sampled rows are ordered.
            self.running.reqs = joining + self.running.reqs if batch.num_decode else self.running.reqs + joining
        else:
            for req in batch.reqs:
                req.kv_len += 1

    def apply_results(self, batch: Batch, next_ids: list[int], elapsed: float) -> None:
        """The sampled ids of an advanced batch: append them, decide finishes (releasing KV), emit.
        A request that finished or was aborted while the forward ran (overlap scheduling: its finish
        was known one step late) drops its token."""
        now = time.monotonic()
        if batch.is_prefill:
            assert batch.kv_ends is not None  # advance ran
            for req, end in zip(batch.reqs, batch.kv_ends, strict=False):
                req.timings.prefill_s += elapsed
                if not req.finished:
                    self.kv.cache_prefix(req, end)
            self.stats.prefill_s += elapsed
        else:
            self.stats.decode_s += elapsed
            self.stats.decode_rows += len(batch.reqs)
        kept = 0
        for row, token in zip(batch.sample_rows, next_ids, strict=True):
            req = batch.reqs[row]
            if req.finished:
                self.stats.dropped_tokens += 1
                continue
            # Overlap scheduling resolves a forward before anything may retract its requests.
            assert req.status == ReqStatus.RUNNING, f"rid={req.rid}: a token for a {req.status.value} request"
            kept += 1
            if req.params.max_tokens == 0:  # a prompt scored, nothing generated (SGLang, OpenAI echo)
                self.finish(req, Finish("length"))
                continue
            req.output_ids.append(token)
            req.timings.last_token = now
            reason = self.grammar.accept(req, token) or self.finisher.check(req)
            if reason is not None:
                self.finish(req, reason)
                continue
            # Every stream_interval tokens; the first token at once (TTFT), the finish above.
            unsent = len(req.output_ids) - req.sent_offset
            if req.stream and (req.sent_offset == 0 or unsent >= self.stream_interval):
                self._emit.append(make_output(req))
        self.stats.generated_tokens += kept
        if len(self.running.reqs) and any(r.finished for r in self.running.reqs):
            self.running.reqs = [r for r in self.running.reqs if not r.finished]

    def finish(self, req: Req, reason: Finish, cache: bool = True) -> None:
        req.finished_reason = reason
        req.status = ReqStatus.FINISHED
        req.grammar = None
        self.kv.release(req, cache=cache)
        self.stats.finished += 1
        self.recent.append((time.monotonic(), req))
        self._emit.append(make_output(req, full=not req.stream))

    def take_outputs(self) -> list[TokenDelta]:
        """What this step emits (and empties the list)."""
        out, self._emit = self._emit, []
        return out

    # -- intake, aborts, resync ------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """A request the inbox accepted (its prompt fits: the inbox refuses those that do not)."""
        if req.params.seed is not None:
            req.generator = make_generator(req.params.seed, self.device)
        prompt_logprobs.seed(req)
        if self.grammar.is_constrained(req):
            req.status = ReqStatus.GRAMMAR
            refused = self.grammar.submit(req)  # joins waiting once its grammar compiled
            if refused is not None:
                req.finished_reason = refused
                req.status = ReqStatus.FINISHED
                self.recent.append((time.monotonic(), req))
                self._emit.append(make_output(req, full=True))
        else:
            self._wait(req)

    def _wait(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def abort(self, pred: Callable[[Req], bool]) -> list[Req]:
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
        self.running.reqs = keep
        for r in gone:
            r.finished_reason = Finish.abort(grpc.StatusCode.OK, "aborted")
            r.status = ReqStatus.FINISHED
            r.grammar = None
        return gone

    def abort_all(self, message: str) -> list[Req]:
        """End every live request with finish_reason abort and `message`; unlike `abort`, each one's
        finish is emitted, since its owner did not ask for it."""
        gone = self.abort(lambda r: True)
        now = time.monotonic()
        for r in gone:
            r.finished_reason = Finish.abort(grpc.StatusCode.OK, message)
            self.stats.finished += 1
            self.recent.append((now, r))
            self._emit.append(make_output(r, full=not r.stream))
        return gone

    def retract_all(self) -> int:
        """Send every running (and the mid-prefill) request back to the front of `waiting`; their KV
        goes into the prefix cache and they recompute later (pause mode retract). Returns how many."""
        reqs, self.running.reqs = self.running.reqs, []
        n = len(reqs)
        if self.chunked is not None:
            self._requeue_chunked()
            n += 1
        for r in reqs:
            self.kv.release(r, cache=True)
            r.reset_for_recompute()
        self.waiting.extendleft(reversed(reqs))
        self.stats.retractions += len(reqs)
        return n

    def num_started(self) -> int:
        """Requests that have produced tokens or hold KV: what must finish before new weights."""
        return (len(self.running) + (self.chunked is not None)
                + sum(1 for r in self.waiting if r.output_ids))

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

    def has_outputs(self) -> bool:
        """Finishes to send (what a paused engine still steps for)."""
        return bool(self._emit)

    def num_queued(self) -> int:
        """Requests not yet running: waiting plus compiling their grammar."""
        return len(self.waiting) + len(self.grammar)


def lora_ids(reqs: list[Req]) -> list[int] | None:
    """[B] each request's adapter uid for the ForwardBatch; None when none has one (no LoRA work)."""
    ids = [r.lora_uid for r in reqs]
    return ids if any(ids) else None


def argmax_only(reqs: list[Req]) -> bool:
    """Whether every request's next token is its logits' argmax and nothing else reads them (ForwardBatch.greedy):
    sampling_info's fast_greedy (min_new_tokens taken as met only once the output is that long), and no
    grammar, no logprobs."""
    return all(r.params.argmax_of_logits and r.grammar is None and len(r.output_ids) >= r.params.min_new_tokens
               and not r.return_logprob and not r.top_logprobs_num for r in reqs)


def sample_reqs(reqs: list[Req], logits: torch.Tensor, grammar: GrammarGlue, finisher: FinishChecker,
                vocab_size: int, device: torch.device,
                argmax: Callable[[torch.Tensor], list[int]] | None = None,
                logit_bias: LogitBias | None = None) -> list[int]:
    """The requests' state (params, generators, outputs so far, grammars, the min_new_tokens stop ids)
    turned into one SamplingBatchInfo, the sampler run, and each request's logprobs recorded.
    logits: [len(reqs), V] on device, one row per request (or [len(reqs)] argmax ids, from a forward of a
    batch argmax_only() passed: ForwardBatch.greedy); argmax: the C kernel's, when the model runs
    on them; logit_bias: the scheduler's cache of bias tensors. Returns each request's next token id."""
    if not reqs:
        return []
    grammar.mask(logits, reqs)
    info = sampling_info(reqs, finisher, vocab_size, device, logit_bias)
    out = sample(logits, info, [r.return_logprob for r in reqs], [r.top_logprobs_num for r in reqs], argmax)
    record_logprobs(reqs, out)
    return out.next_token_ids


def sampling_info(reqs: list[Req], finisher: FinishChecker, vocab_size: int, device: torch.device,
                  logit_bias: LogitBias | None = None) -> SamplingBatchInfo:
    """The requests' sampling state (params, generators, outputs so far, the min_new_tokens stop ids)
    as one SamplingBatchInfo."""
    return SamplingBatchInfo.build(
        [r.params for r in reqs], [r.generator for r in reqs], [r.output_ids for r in reqs],
        [r.origin_input_ids for r in reqs],
        # A grammar decides for itself when EOS may come; masking it too could leave no token.
        [set(finisher.stop_ids_for_min_tokens(r))
         if r.params.min_new_tokens > len(r.output_ids) and r.grammar is None else set() for r in reqs],
        vocab_size, device, logit_bias)


def record_logprobs(reqs: list[Req], out: SampleOutput) -> None:
    """Each request's logprobs of its sampled token, when asked for and the token is kept."""
    for r, lp, top in zip(reqs, out.logprobs, out.top_logprobs, strict=True):
        # max_tokens 0: the token is not kept; finished: it finished while this forward ran (overlap).
        if r.return_logprob and r.params.max_tokens and not r.finished:
            r.output_logprobs.append(lp)
            r.output_top_logprobs.append(top)
