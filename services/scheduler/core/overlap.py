"""Overlap scheduling: the CPU schedules step N+1 and takes in step N-1's tokens while the forward of
step N runs (SGLang's overlap scheduler, with its one-step lag on sampled ids).

The order of one engine step with overlap:

    recv -> schedule N+1 -> launch N+1 (the forward and the sampling, queued on the worker)
         -> resolve N (wait for its ids; append them, decide finishes, emit) -> send

so the device (or, on CPU, the worker thread: torch releases the GIL inside its ops) runs forward N+1
while this thread applies N's results and, on the next step, builds N+2. Forwards run one at a time
on one worker, in launch order; on CUDA on the worker's own stream, after the scheduler's copies.

The lag, and how each edge is handled:
- Step N+1 is scheduled before N's tokens are known. A request decoding in both takes, as its input
  id, a placeholder (< 0, `Req.future_id`) for the token N samples; the worker writes N's ids into the
  `FutureMap` and resolves N+1's placeholders from it before the forward, on the device, no round trip.
- What a forward does to the KV bookkeeping (KV lengths, prefilled requests joining the running
  batch) is applied at launch (`Scheduler.advance`), so N+1 is scheduled on it; the tokens, finishes
  and outputs at resolve (`Scheduler.apply_results`).
- A request that finishes at N (EOS, stop, max tokens) is known one step late: N+1 already computes
  one more token for it, which is dropped; its KV (that extra slot too) is released at its finish.
- A req_to_token row freed while a forward in flight may read it (finish, abort) is handed out again
  only after that forward ran (`ReqToTokenPool.fence`); KV slots need no such care, since every write
  to them happens on the worker, in order. The radix cache takes a prefill's KV at resolve, up to
  what the resolved forwards wrote.
- Sampling that needs the previous token on the CPU (a grammar's mask, penalties, min_new_tokens'
  EOS mask) and prompt logprobs (read at sampling from the request's KV position) run without the
  lag: the forward in flight is resolved before such a batch is scheduled or run (`needs_cpu_state`).
  So is one that may retract (the pool is short: a retracted request's recompute prompt is its
  output so far), and every control operation (pause, abort all, weight update, flush:
  `Engine.locked`).
Greedy output is the same with overlap on and off (tests/scheduler/test_overlap.py, tests/e2e).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from services.scheduler.core import prompt_logprobs
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Batch, Scheduler, record_logprobs, sampling_info
from services.scheduler.model_executor.model_runner import ModelRunner
from services.scheduler.model_executor.sampling import SampleOutput, sample

log = logging.getLogger(__name__)
WORKER_QUEUE = 2  # forwards queued at most: the one in flight and the one just launched
STOP_JOIN_S = 5.0


def needs_cpu_state(req: Req) -> bool:
    """Sampling this request reads its previous token (or the count of its tokens) on the CPU, so the
    forward that samples that token must be resolved before its next one is launched."""
    p = req.params
    return req.grammar is not None or p.has_penalties or p.min_new_tokens > len(req.output_ids)


class FutureMap:
    """Ids sampled by forwards not yet resolved, by placeholder: placeholder -(i + 1) is slot i of a
    ring on the device. Written and read only on the worker, in forward order, so a placeholder is
    always resolved after the forward that samples it. The ring holds four batches of rows; no more
    than two are ever live (the forward in flight's and the one launched after it)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ids = torch.zeros(4 * rows, dtype=torch.int64, device=device)  # [4 * rows] int64
        self.device = device
        self._next = 0

    def reserve(self, n: int) -> list[int]:
        """n fresh placeholders (each < 0)."""
        size = self.ids.numel()
        slots = [(self._next + k) % size for k in range(n)]
        self._next = (self._next + n) % size
        return [-(s + 1) for s in slots]

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 with placeholders -> [T] with the ids they stand for."""
        return torch.where(input_ids < 0, self.ids[(-input_ids - 1).clamp_min(0)], input_ids)

    def store(self, placeholders: list[int], next_ids: list[int]) -> None:
        slots = torch.tensor([-p - 1 for p in placeholders], dtype=torch.int64).to(self.device)
        self.ids[slots] = torch.tensor(next_ids, dtype=torch.int64).to(self.device)


class ForwardWorker:
    """One thread that runs jobs (forwards) in submission order; on CUDA on its own stream, which
    waits for the submitting thread's stream first (the batch's copies to the device)."""

    def __init__(self, device: torch.device) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any], Any] | None] = queue.Queue(WORKER_QUEUE)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        thread = threading.Thread(target=_work, args=(self._jobs, self._stream), name="forward", daemon=True)
        thread.start()
        # The thread ends with its worker, or at exit before the interpreter tears down (a thread
        # still inside torch's thread pool then can abort the process).
        weakref.finalize(self, _stop, self._jobs, thread)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # on this thread's current stream
        self._jobs.put((job, fut, ready))
        return fut


def _stop(jobs: queue.Queue[Any], thread: threading.Thread) -> None:
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(STOP_JOIN_S)


def _work(jobs: queue.Queue[tuple[Callable[[], Any], Future[Any], Any] | None], stream: Any) -> None:
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        while (item := jobs.get()) is not None:
            job, fut, ready = item
            try:
                if ready is not None:
                    stream.wait_event(ready)
                result = job()
                if stream is not None:
                    stream.synchronize()  # its tensors are read on the scheduler's thread next
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread, which exits
                fut.set_exception(e)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Result(NamedTuple):
    out: SampleOutput
    elapsed_s: float   # the forward and the sampling, on the worker


@dataclass
class InFlight:
    batch: Batch
    reqs: list[Req]            # its sampled rows' requests
    placeholders: list[int]    # of their tokens
    seq: int                   # its number (the req_to_token fence)
    result: Future[Result]


@dataclass
class OverlapStats:
    """Steps launched with the lag, and those run without it (tests, the benchmark's note)."""

    overlapped: int = 0
    synced: int = 0


class Overlap:
    """The engine's forward loop with overlap scheduling: `run` once per step with the scheduled batch
    (or None); `resolve` whenever the scheduler's state must be current (`Engine.locked`)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.rows = runner.req_to_token_pool
        self.worker = ForwardWorker(runner.device)
        self.futures = FutureMap(self.rows.size, runner.device)
        self.stats = OverlapStats()
        self._inflight: InFlight | None = None
        self._seq = 0
        # A forward that raised: every later step raises too, so the engine thread exits (Engine.run)
        # even when a control call on another thread was the one that resolved it.
        self._failed: BaseException | None = None

    @property
    def pending(self) -> bool:
        """A forward is in flight: its results are still to be applied."""
        return self._inflight is not None

    def must_resolve_first(self) -> bool:
        """Before scheduling: does the next batch need the tokens of the forward in flight? (A request
        of it samples from CPU state, or the pool is short enough that the decode may retract.)"""
        f = self._inflight
        if f is None:
            return False
        s = self.scheduler
        return any(needs_cpu_state(r) for r in f.reqs) or s.kv.available() < len(s.running)

    def run(self, batch: Batch | None) -> None:
        """Launch this step's batch and resolve the previous one while it runs; a batch that needs
        current CPU state runs after the previous one is resolved, without the lag."""
        self._check()
        if batch is None:
            self.resolve()
            return
        if batch.forward.logit_rows is not None or any(needs_cpu_state(r) for r in batch.reqs):
            self.resolve()
            self._run_synced(batch)
            self.stats.synced += 1
            return
        launched = self._launch(batch)
        self.resolve()
        self._inflight = launched
        self.stats.overlapped += 1

    def resolve(self) -> None:
        """Wait for the forward in flight; apply its tokens (those of requests that finished or were
        aborted meanwhile are dropped)."""
        self._check()
        f, self._inflight = self._inflight, None
        if f is None:
            return
        try:
            res = f.result.result()
        except BaseException as e:
            self._failed = e
            raise
        for r, p in zip(f.reqs, f.placeholders, strict=True):
            if r.future_id == p:  # no later launch took its place: the token is in output_ids now
                r.future_id = None
        record_logprobs(f.reqs, res.out)
        self.scheduler.apply_results(f.batch, res.out.next_token_ids, res.elapsed_s)
        self.rows.passed(f.seq)
        if f.seq == self._seq:  # nothing launched after it
            self.rows.fence = 0

    def _check(self) -> None:
        if self._failed is not None:
            raise RuntimeError("a forward failed on the worker") from self._failed

    def _launch(self, batch: Batch) -> InFlight:
        s, runner = self.scheduler, self.runner
        rows = batch.sample_rows
        reqs = [batch.reqs[i] for i in rows]
        # Built now, from state that lags one token: needs_cpu_state keeps out what that would change.
        info = sampling_info(reqs, s.finisher, runner.vocab_size, runner.device, s.logit_bias)
        want = [r.return_logprob for r in reqs]
        tops = [r.top_logprobs_num for r in reqs]
        placeholders = self.futures.reserve(len(reqs))
        s.advance(batch)
        for r, p in zip(reqs, placeholders, strict=True):
            r.future_id = p
        self._seq += 1
        self.rows.fence = self._seq
        fb, futures, whole = batch.forward, self.futures, len(rows) == len(batch.reqs)

        def job() -> Result:  # on the worker
            t0 = time.monotonic()
            fb.input_ids = futures.resolve(fb.input_ids)
            logits = runner.forward(fb)  # [B, V]
            if not reqs:  # only a prompt chunk: nothing sampled
                return Result(SampleOutput([], [], []), time.monotonic() - t0)
            out = sample(logits if whole else logits[rows], info, want, tops, runner.argmax)
            futures.store(placeholders, out.next_token_ids)
            return Result(out, time.monotonic() - t0)

        return InFlight(batch, reqs, placeholders, self._seq, self.worker.submit(job))

    def _run_synced(self, batch: Batch) -> None:
        """The step as without overlap, but with the forward on the worker (after any before it, whose
        placeholders it may still hold)."""
        s, runner, futures, fb = self.scheduler, self.runner, self.futures, batch.forward

        def job() -> torch.Tensor:
            fb.input_ids = futures.resolve(fb.input_ids)
            return runner.forward(fb)

        t0 = time.monotonic()
        logits = prompt_logprobs.take(batch.reqs, fb, self.worker.submit(job).result())  # [B, V]
        s.process_results(batch, s.sample(batch, logits), time.monotonic() - t0)
