"""The engine: the model runner, the KV caches and the Scheduler, stepped by one thread.

A step is one path (`step`): receive what the inbox holds -> schedule a batch -> forward it on the
model runner -> process the sampled tokens -> send this step's deltas. `run` is the engine thread
around it: wait for work, step, hand each step's StepBatch to the push stream.

With overlap scheduling (core/overlap.py, unless --disable-overlap-schedule) the forward runs on a
worker while the step schedules the next batch and applies the previous one's tokens.

Other threads only `submit` / `abort` / `abort_owner` / `request_resync` (they queue into the inbox,
bounded) and read `load()` / `stats()` (snapshots taken after each step). `flush_cache`, `resync` and
core/control.py take the step's lock through `locked`, so they are safe from any thread and see the
scheduler's state current. Knows nothing of gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from ringserve.errors import NotFound
from ringserve.message import Finish, Load, SamplingParams, StepBatch, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from services.scheduler import memory
from services.scheduler.config import EngineConfig
from services.scheduler.core import prompt_logprobs
from services.scheduler.core.finish import FinishChecker
from services.scheduler.core.inbox import AbortOwner, AbortRid, Inbox, QueueFull, Resync
from services.scheduler.core.outputs import GenerationResult, make_output
from services.scheduler.core.overlap import Overlap
from services.scheduler.core.prefill import default_chunk_size
from services.scheduler.core.profiler import StepProfiler
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler, SchedulerStats
from services.scheduler.grammar import GrammarMetrics
from services.scheduler.grammar.setup import GrammarPrefetch, build_grammar
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.kvcache.radix_cache import RadixCache
from services.scheduler.lora.adapter import parse_lora_paths
from services.scheduler.lora.manager import settings_for
from services.scheduler.model_executor.model_runner import ModelRunner

log = logging.getLogger(__name__)
THROUGHPUT_WINDOW_S = 1.0
IDLE_WAIT_S = 0.5


def _rid_is(rid: str) -> Callable[[Req], bool]:
    """An abort predicate: the request with this rid."""
    def pred(r: Req) -> bool:
        return r.rid == rid
    return pred


def _owner_is(owner: str) -> Callable[[Req], bool]:
    """An abort predicate: every request of this tokenizer replica."""
    def pred(r: Req) -> bool:
        return r.owner == owner
    return pred


# send(batch, reconnect): reconnect marks the full resync after the push stream (re)connected.
Send = Callable[[StepBatch, bool], None]


class Engine:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner | None = None,
                 grammar_metrics: GrammarMetrics | None = None) -> None:
        """grammar_metrics: the process's (prometheus' default registry takes one per process)."""
        self.cfg = cfg
        prefetch = GrammarPrefetch.start(cfg.grammar_backend)  # its import overlaps the model load
        log.info("loading model %s", cfg.model)
        grammar_bound = ([memory.Bound(cfg.grammar_cache_mib << 20, "grammar cache", "--grammar-cache-mib")]
                         if cfg.grammar_backend != "none" else [])
        self.runner = runner or ModelRunner(
            cfg.model, device=cfg.device, dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
            max_total_tokens=cfg.max_total_tokens,
            mem_fraction=cfg.mem_fraction, max_running_requests=cfg.max_running_requests,
            context_length=cfg.context_length, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            disable_cuda_graph=cfg.disable_cuda_graph, num_threads=cfg.num_threads, decode_threads=cfg.decode_threads,
            cpu_kernels=not cfg.disable_cpu_kernels, kernel_cache=cfg.kernel_cache,
            decode_cache_bytes=None if cfg.decode_cache_mib is None else cfg.decode_cache_mib << 20,
            attention_backend=cfg.attention_backend, other_bounds=grammar_bound,
            synthetic_forward=cfg.synthetic_forward,
            lora=settings_for(cfg.lora_enabled, cfg.lora_paths, cfg.max_loras_per_batch, cfg.max_lora_rank,
                              cfg.lora_target_modules, cfg.max_loaded_loras))
        self.lora = self.runner.lora
        if self.lora is not None:
            for name, path in parse_lora_paths(cfg.lora_paths):
                self.lora.add(self.lora.read(name, path), pinned=False)
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
            decode_interleave=not cfg.disable_decode_interleave,
            schedule_conservativeness=cfg.schedule_conservativeness,
            max_loras_per_batch=self.lora.settings.max_loras_per_batch if self.lora is not None else 0)
        self.inbox = Inbox(cfg.max_queued_requests, self.max_prompt_tokens)
        overlap = (not cfg.disable_overlap_schedule if cfg.disable_overlap_schedule is not None
                   else self.runner.device.type == "cuda")
        self.overlap = Overlap(self.runner, self.scheduler) if overlap else None
        log.info("overlap schedule: %s", "off" if self.overlap is None else "on")
        self._lock = threading.Lock()          # serializes step / flush / resync
        self._resyncs: list[tuple[str | None, list[TokenDelta]]] = []  # computed at a step's start
        self._load = Load(max_total_num_tokens=self.max_total_num_tokens)
        self._stats = SchedulerStats()
        self._window = (time.monotonic(), 0)
        self._throughput = 0.0
        self._last_step = 0.0
        self.paused: str | None = None     # the pause mode while paused (core/control.py)
        self.profiler = StepProfiler()

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that can still produce a token (context and KV pool both bound it)."""
        return min(self.runner.context_length, self.max_total_num_tokens) - 1

    @property
    def weight_version(self) -> str:
        """Of the weights loaded now (a weight update changes it: core/control.py)."""
        return self.scheduler.weight_version

    def warmup(self) -> None:
        self.runner.warmup()

    # -- intake (any thread) ---------------------------------------------------------------------

    def submit(self, req: Req) -> None:
        """Queue a request; raises InvalidArgument (prompt), NotFound (its LoRA adapter is not loaded
        here) or QueueFull (--max-queued-requests)."""
        if req.lora_name:
            self.resolve_lora(req.lora_name)  # refuse early; recv resolves it for good
        self.inbox.submit(req)

    def resolve_lora(self, name: str) -> int:
        if self.lora is None:
            raise NotFound(f"lora_path: adapter {name!r} is not loaded (this scheduler serves no LoRA "
                           "adapters: start it with --enable-lora or --lora-paths)")
        return self.lora.resolve(name)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.inbox.put(AbortRid(rid))

    def abort_owner(self, owner: str) -> None:
        """Abort every request of a tokenizer replica (its Connect stream ended)."""
        self.inbox.put(AbortOwner(owner))

    def request_resync(self, owner: str | None) -> None:
        """Re-send full state for owner's requests (None: all, after the push stream reconnected)."""
        self.inbox.put(Resync(owner))

    def wake(self) -> None:
        self.inbox.wake()

    # -- the step (the engine thread) ------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """One step: receive -> schedule -> forward -> process -> send (what it returns). With overlap:
        receive -> schedule -> launch -> process the previous forward's tokens -> send."""
        with self._lock:
            self.recv()
            ov = self.overlap
            if ov is not None and ov.must_resolve_first():
                ov.resolve()
            batch = None if self.paused else self.scheduler.schedule()  # paused: intake only
            if ov is not None:
                ov.run(batch)
            elif batch is not None:
                t0 = time.monotonic()
                logits = prompt_logprobs.take(batch.reqs, batch.forward, self.runner.forward(batch.forward))  # [B, V]
                self.scheduler.process_results(batch, self.scheduler.sample(batch, logits), time.monotonic() - t0)
            out = self.scheduler.take_outputs()
            self._update_load()
            self.profiler.on_step(batch is not None)
        if not self.has_work():
            self.inbox.wake()  # wait_idle (the drain)
        for o in out:
            if o.finish is not None:
                log.info("rid=%s finished %s output_tokens=%d cached_tokens=%d", o.rid, o.finish.type,
                         o.offset + len(o.ids), o.cached_tokens)
        return out

    def recv(self) -> None:
        """The inbox, in arrival order: an abort applies to what came before it; resyncs are taken
        before this step runs, so they reach the detokenizer ahead of its deltas."""
        sched = self.scheduler
        for msg in self.inbox.take():
            if isinstance(msg, Req):
                if msg.lora_name:
                    # Here, under the step lock, as an unload checks for users: an adapter unloaded
                    # between submit and now ends the request instead of reaching a forward.
                    try:
                        msg.lora_uid = self.resolve_lora(msg.lora_name)
                    except NotFound as e:
                        sched.finish(msg, Finish.abort(grpc.StatusCode.NOT_FOUND, e.message), cache=False)
                        continue
                sched.add_request(msg)
                log.info("rid=%s queued prompt_tokens=%d owner=%s", msg.rid, msg.prompt_tokens, msg.owner)
            elif isinstance(msg, AbortRid):
                for r in sched.abort(_rid_is(msg.rid)):
                    log.info("rid=%s aborted", r.rid)
            elif isinstance(msg, AbortOwner):
                for r in sched.abort(_owner_is(msg.owner)):
                    log.info("rid=%s aborted owner=%s (stream closed)", r.rid, r.owner)
            else:
                self._resyncs.append((msg.owner, self._resync(msg.owner)))

    def run(self, stop: threading.Event, send: Send, on_step: Callable[[list[TokenDelta]], None] | None = None) -> None:
        """The engine thread until `stop`: wait for work, step, send. A bug exits the process (to be
        restarted) rather than leave the service up with a dead engine."""
        released = True  # nothing grown yet
        while not stop.is_set():
            if not self.wait_for_work(IDLE_WAIT_S):
                if not released:
                    released = self.release_idle()
                continue
            released = False
            try:
                out = self.step()
            except Exception:
                log.exception("engine step failed; exiting")
                logging.shutdown()
                os._exit(1)
            for owner, outs in self.take_resyncs():
                send(StepBatch(outs, sent_at=time.time(), resync=True), owner is None)
                log.info("resync sent owner=%s requests=%d", owner or "*", len(outs))
            if out:
                send(StepBatch(out, sent_at=time.time()), False)
            if on_step is not None:
                on_step(out)

    def release_idle(self) -> bool:
        """Once idle (IDLE_WAIT_S without work): return what the load grew (decode caches, allocator
        free lists) to the OS, so the process's RSS goes back to its idle level. False if busy again."""
        with self.locked():
            if self.has_work():
                return False
            t0 = time.monotonic()
            rss0 = memory.rss_bytes()
            self.runner.release_idle()
            log.info("idle: released %.0f MiB in %.0f ms (RSS %.0f MiB)", (rss0 - memory.rss_bytes()) / memory.MIB,
                     1000 * (time.monotonic() - t0), memory.rss_bytes() / memory.MIB)
            return True

    def memory_items(self) -> list[memory.MemoryItem]:
        """Each holder of the scheduler's memory now, with its bound (memory.py's table)."""
        tree = self.tree
        slots = 8 * tree.total_size()  # int64 slot ids; the nodes' Python objects are runtime
        return [*self.runner.memory_items(),
                memory.MemoryItem("radix_cache", slots, 8 * self.max_total_num_tokens, "--max-total-tokens"),
                self.grammar.memory_item()]

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The step lock, with the forward in flight (overlap) resolved: the scheduler's state is
        current, and nothing runs on the model until the lock is let go (control, flush, resync)."""
        with self._lock:
            if self.overlap is not None and self.overlap.pending:
                self.overlap.resolve()  # its finishes go out with the next step
                self._update_load()
            yield

    def take_resyncs(self) -> list[tuple[str | None, list[TokenDelta]]]:
        with self._lock:
            out, self._resyncs = self._resyncs, []
        return out

    def wait_for_work(self, timeout: float) -> bool:
        """Block until there is something to do (or timeout); the engine thread's idle wait."""
        s = self.scheduler
        busy = ((s.has_outputs() if self.paused else s.has_work()) or self.profiler.pending
                or (self.overlap is not None and self.overlap.pending))
        deadline = None if busy else self.grammar.next_deadline_s()  # a compile timeout must fire while idle
        return self.inbox.wait(timeout if deadline is None else min(timeout, deadline), busy)

    def wait_idle(self, timeout: float) -> bool:
        """Until no request is queued, compiling its grammar or running (or timeout); True when idle."""
        end = time.monotonic() + timeout
        while self.busy() and time.monotonic() < end:
            self.inbox.wait(min(0.05, max(0.0, end - time.monotonic())), busy=False)
        return not self.busy()

    def busy(self) -> bool:
        """has_work from another thread: under the step lock, since a step's recv moves requests from
        the inbox to the scheduler, and between the two neither would show them."""
        with self._lock:
            return self.has_work()

    def _update_load(self) -> None:
        s = self.scheduler
        now = time.monotonic()
        start, gen0 = self._window
        if now - start >= THROUGHPUT_WINDOW_S:
            self._throughput = (s.stats.generated_tokens - gen0) / (now - start)
            self._window = (now, s.stats.generated_tokens)
        used = self.kv.used_tokens()
        st = s.stats
        self.inbox.queued = s.num_queued()
        self._load = Load(
            num_running_reqs=len(s.running) + (s.chunked is not None), num_queue_reqs=s.num_queued(),
            num_used_tokens=used, max_total_num_tokens=self.max_total_num_tokens,
            token_usage=used / self.max_total_num_tokens,
            cache_hit_rate=st.cached_prompt_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
            gen_throughput=self._throughput)
        self._stats = dataclasses.replace(st)
        self._last_step = now

    def load(self) -> Load:
        """The last step's snapshot (safe from any thread; never waits for a step)."""
        ld = self._load
        if time.monotonic() - self._last_step > 2 * THROUGHPUT_WINDOW_S and ld.gen_throughput:
            ld = dataclasses.replace(ld, gen_throughput=0.0)
        pending = self.inbox.pending_requests
        used, bound = memory.total(self.memory_items())
        return dataclasses.replace(ld, num_queue_reqs=ld.num_queue_reqs + pending, memory_accounted_bytes=used,
                                   memory_bound_bytes=bound, rss_bytes=memory.rss_bytes())

    def stats(self) -> SchedulerStats:
        """The scheduler's counters as of the last step (safe from any thread)."""
        return self._stats

    def has_work(self) -> bool:
        """Anything not finished: intake, queued, compiling a grammar, running or unsent output."""
        return (bool(self.inbox) or self.scheduler.has_work() or len(self.grammar) > 0
                or (self.overlap is not None and self.overlap.pending))

    # -- control ---------------------------------------------------------------------------------

    def flush_cache(self) -> tuple[bool, str]:
        with self.locked():
            if self.has_work():
                return False, "requests are running or queued"
            self.kv.flush()
            self._update_load()
            log.info("prefix cache flushed")
            return True, ""

    def resync(self, owner: str | None) -> list[TokenDelta]:
        """Full state (offset 0, all ids, params) of live and recently finished requests of owner (None: all)."""
        with self.locked():
            return self._resync(owner)

    def _resync(self, owner: str | None) -> list[TokenDelta]:
        s = self.scheduler
        outs = []
        for req in [*s.live_reqs(), *s.recent_finished()]:
            if owner is not None and req.owner != owner:
                continue
            if not req.finished and not (req.stream and req.params_sent):
                continue  # it will carry its params on its first delta anyway
            outs.append(make_output(req, full=True))
        return outs

    # -- in-process use (tests, benchmarks) ------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1, lora: list[str] | None = None) -> list[GenerationResult]:
        """Submit all prompts and step until every one finished. lora: each prompt's adapter name ("": none)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        loras = lora or [""] * len(prompts)
        base = f"gen-{time.monotonic_ns()}"
        reqs = [Req(rid=f"{base}-{i}", origin_input_ids=list(ids), params=p, stream=False,
                    return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                    logprob_start_len=logprob_start_len, lora_name=name)
                for i, (ids, p, name) in enumerate(zip(prompts, params, loras, strict=True))]
        pending = deque(reqs)
        while not all(r.finished for r in reqs):
            while pending:  # as many as the queue takes; the rest after the next step
                try:
                    self.submit(pending[0])
                except QueueFull:
                    break
                pending.popleft()
            if not self.scheduler.has_work():  # only grammars compiling: sleep until one is ready
                self.wait_for_work(0.05)
            self.step()
        with self.locked():  # the forward launched after the last finish: its tokens are dropped
            pass
        return [GenerationResult.of(r) for r in reqs]
