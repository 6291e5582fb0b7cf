"""The engine: model runner + radix cache + scheduler behind a thread-safe intake.

Other threads call `submit`, `abort`, `abort_owner` (they only queue work, bounded) and read `load()`
(a snapshot taken after each step). One thread calls `step()`; `flush_cache` and `resync` take the
same lock as `step`, so they are safe from any thread. Knows nothing of gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.config import EngineConfig
from services.scheduler.core.finish import FinishChecker
from services.scheduler.grammar import GrammarMetrics
from services.scheduler.grammar.setup import GrammarPrefetch, build_grammar
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.model_executor.model_runner import ModelRunner
from services.scheduler.core.outputs import GenerationResult, ReqOutput, make_output
from services.scheduler.kvcache.radix_cache import RadixCache
from services.scheduler.core.req import Req
from services.scheduler.model_executor.sampling import SamplingParams
from services.scheduler.core.prefill import default_chunk_size
from services.scheduler.core.scheduler import Scheduler

log = logging.getLogger(__name__)
THROUGHPUT_WINDOW_S = 1.0


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests."""


@dataclass(frozen=True)
class Load:
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    num_retracted_reqs: int = 0
    # The step profile since start (SchedulerStats): steps, seconds, requests per decode step.
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_rows: int = 0


class Engine:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner | None = None,
                 grammar_metrics: GrammarMetrics | None = None) -> None:
        """grammar_metrics: the process's (prometheus' default registry takes one per process)."""
        self.cfg = cfg
        prefetch = GrammarPrefetch.start(cfg.grammar_backend)  # its import overlaps the model load
        log.info("loading model %s", cfg.model)
        self.runner = runner or ModelRunner(
            cfg.model, device=cfg.device, dtype=cfg.dtype, max_total_tokens=cfg.max_total_tokens,
            mem_fraction=cfg.mem_fraction, max_running_requests=cfg.max_running_requests,
            context_length=cfg.context_length, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            disable_cuda_graph=cfg.disable_cuda_graph, num_threads=cfg.num_threads, decode_threads=cfg.decode_threads,
            cpu_kernels=not cfg.disable_cpu_kernels, kernel_cache=cfg.kernel_cache)
        self.tokenizer = TextTokenizer.from_model(cfg.model)
        self.tree = RadixCache(self.runner.token_to_kv_pool, self.runner.device, disable=cfg.disable_radix_cache)
        self.kv = KVManager(self.runner.req_to_token_pool, self.runner.token_to_kv_pool, self.tree)
        self.max_total_num_tokens = self.runner.max_total_num_tokens
        self.chunked_prefill_size = default_chunk_size(cfg.chunked_prefill_size, self.runner.device)
        finisher = FinishChecker(self.tokenizer, self.runner.eos_token_ids, self.runner.context_length)
        self.grammar = build_grammar(cfg, self.runner, prefetch, on_ready=self.wake, metrics=grammar_metrics)
        self.scheduler = Scheduler(
            self.runner, self.kv, finisher, schedule_policy=cfg.schedule_policy,
            max_running_requests=cfg.max_running_requests, max_prefill_tokens=cfg.max_prefill_tokens,
            chunked_prefill_size=self.chunked_prefill_size, stream_interval=cfg.stream_interval,
            grammar=self.grammar, mixed_chunk=cfg.enable_mixed_chunk,
            decode_interleave=not cfg.disable_decode_interleave)
        self._lock = threading.Lock()          # serializes step / flush / resync
        self._intake_lock = threading.Condition()
        # Intake events in arrival order: ("req", Req) | ("abort", rid) | ("owner", owner).
        self._intake: deque[tuple[str, object]] = deque()
        self._num_new = 0
        self._queued = 0                        # submitted, not yet admitted past the waiting queue
        self._load = Load(max_total_num_tokens=self.max_total_num_tokens)
        self._window = (time.monotonic(), 0)
        self._throughput = 0.0
        self._last_step = 0.0

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that can still produce a token (context and KV pool both bound it)."""
        return min(self.runner.context_length, self.max_total_num_tokens) - 1

    def warmup(self) -> None:
        self.runner.warmup()

    # -- intake (any thread) ---------------------------------------------------------------------

    def submit(self, req: Req) -> None:
        """Queue a request; raises QueueFull at --max-queued-requests."""
        with self._intake_lock:
            if self._queued >= self.cfg.max_queued_requests:
                raise QueueFull(f"{self._queued} requests queued (max {self.cfg.max_queued_requests})")
            self._queued += 1
            self._num_new += 1
            self._intake.append(("req", req))
            self._intake_lock.notify()

    def abort(self, rids: list[str]) -> None:
        with self._intake_lock:
            self._intake.extend(("abort", rid) for rid in rids)
            self._intake_lock.notify()

    def abort_owner(self, owner: str) -> None:
        """Abort every request of a tokenizer replica (its Connect stream ended)."""
        with self._intake_lock:
            self._intake.append(("owner", owner))
            self._intake_lock.notify()

    def wait_for_work(self, timeout: float) -> bool:
        """Block until there is something to do (or timeout); the engine thread's idle wait."""
        with self._intake_lock:
            if not (self._intake or self.scheduler.has_work()):
                deadline = self.grammar.next_deadline_s()  # a compile timeout must fire while idle
                self._intake_lock.wait(timeout if deadline is None else min(timeout, deadline))
            return bool(self._intake or self.scheduler.has_work())

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is queued, compiling its grammar or running (or timeout); True when idle."""
        with self._intake_lock:
            if self.has_work():
                self._intake_lock.wait(timeout)
            return not self.has_work()

    def wake(self) -> None:
        with self._intake_lock:
            self._intake_lock.notify_all()

    # -- the step (one thread) -------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        with self._lock:
            self._drain_intake()
            out = self.scheduler.step()
            with self._intake_lock:
                self._queued = self._num_new + self.scheduler.num_queued()
            self._update_load(len(out) > 0)
            if not self.scheduler.has_work():
                with self._intake_lock:
                    self._intake_lock.notify_all()  # wakes wait_idle (drain)
        for o in out:
            if o.finish is not None:
                log.info("rid=%s finished %s output_tokens=%d cached_tokens=%d", o.rid, o.finish.type,
                         o.offset + len(o.ids), o.cached_tokens)
        return out

    def _drain_intake(self) -> None:
        with self._intake_lock:
            events, self._intake = self._intake, deque()
            self._num_new = 0
        sched = self.scheduler
        for kind, arg in events:  # in arrival order: an abort applies to what came before it
            if kind == "req":
                sched.add_request(arg)
                log.info("rid=%s queued prompt_tokens=%d owner=%s", arg.rid, arg.prompt_tokens, arg.owner)
            elif kind == "abort":
                for r in sched.abort(lambda r, rid=arg: r.rid == rid):
                    log.info("rid=%s aborted", r.rid)
            else:
                for r in sched.abort(lambda r, owner=arg: r.owner == owner):
                    log.info("rid=%s aborted owner=%s (stream closed)", r.rid, r.owner)

    def _update_load(self, produced: bool) -> None:
        s = self.scheduler
        now = time.monotonic()
        start, gen0 = self._window
        if now - start >= THROUGHPUT_WINDOW_S:
            self._throughput = (s.stats.generated_tokens - gen0) / (now - start)
            self._window = (now, s.stats.generated_tokens)
        used = self.kv.used_tokens()
        st = s.stats
        self._load = Load(
            num_running_reqs=len(s.running) + (s.chunked is not None), num_queue_reqs=s.num_queued(),
            num_used_tokens=used, max_total_num_tokens=self.max_total_num_tokens,
            token_usage=used / self.max_total_num_tokens,
            cache_hit_rate=st.cached_prompt_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
            gen_throughput=self._throughput, num_retracted_reqs=st.retractions,
            prefill_steps=st.prefill_steps, decode_steps=st.decode_steps, prefill_s=st.prefill_s,
            decode_s=st.decode_s, decode_rows=st.decode_rows)
        self._last_step = now

    def load(self) -> Load:
        """The last step's snapshot (safe from any thread; never waits for a step)."""
        ld = self._load
        if time.monotonic() - self._last_step > 2 * THROUGHPUT_WINDOW_S and ld.gen_throughput:
            ld = Load(**{**ld.__dict__, "gen_throughput": 0.0})
        pending = self._num_new
        return Load(**{**ld.__dict__, "num_queue_reqs": ld.num_queue_reqs + pending}) if pending else ld

    def has_work(self) -> bool:
        """Anything not finished: intake, queued, compiling a grammar, running or unsent output."""
        return bool(self._intake) or self.scheduler.has_work() or len(self.grammar) > 0

    # -- control ---------------------------------------------------------------------------------

    def flush_cache(self) -> tuple[bool, str]:
        with self._lock:
            if self.has_work():
                return False, "requests are running or queued"
            self.kv.flush()
            self._update_load(False)
            log.info("prefix cache flushed")
            return True, ""

    def resync(self, owner: str | None) -> list[ReqOutput]:
        """Full state (offset 0, all ids, params) of live and recently finished requests of owner (None: all)."""
        with self._lock:
            s = self.scheduler
            outs = []
            for req in [*s.live_reqs(), *s.recent_finished()]:
                if owner is not None and req.owner != owner:
                    continue
                if not req.finished and not (req.stream and req.params_sent):
                    continue  # it will carry its params on its first delta anyway
                outs.append(make_output(req, full=True))
            return outs

    # -- convenience -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> list[GenerationResult]:
        """Submit all prompts and step until every one finished (in-process use: tests, benchmarks)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        base = f"gen-{time.monotonic_ns()}"
        results = {f"{base}-{i}": GenerationResult(rid=f"{base}-{i}") for i in range(len(prompts))}
        pending = deque(Req(rid=rid, origin_input_ids=list(ids), params=p, stream=False,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                            logprob_start_len=logprob_start_len)
                        for rid, ids, p in zip(results, prompts, params))
        left = len(results)
        while left:
            while pending:  # as many as the queue takes; the rest after the next step
                try:
                    self.submit(pending[0])
                except QueueFull:
                    break
                pending.popleft()
            if not self.scheduler.has_work():  # only grammars compiling: sleep until one is ready
                self.wait_for_work(0.05)
            for out in self.step():
                res = results.get(out.rid)
                if res is None or out.finish is None:
                    continue
                res.output_ids = out.ids
                res.logprobs = out.logprobs or []
                res.top_logprobs = out.top_logprobs or []
                res.input_logprobs = out.input_logprobs or []
                res.finish, res.cached_tokens, res.prompt_tokens = out.finish, out.cached_tokens, out.prompt_tokens
                left -= 1
        return list(results.values())
