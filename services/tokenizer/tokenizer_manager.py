"""TokenizerManager: request intake, rid_to_state and result collection (SGLang's TokenizerManager).

A Generate call is validated and tokenized, expanded into n internal requests, routed to one
scheduler and registered in `rid_to_state`; the detokenizer's deltas fill each ReqState and wake
the call's consumer, which collects outputs until every sample has finished. A state lives from
intake until its consumer releases the call (finished, error, abort, cancel or deadline: the
`finally` of `generate`, or a GenerateStream session's own bookkeeping), so rid_to_state cannot
leak. Nothing here makes gRPC calls: schedulers are reached through the `SchedulerLinks` protocol,
errors are ringserve.errors exceptions and statuses grpc.StatusCode values.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from ringserve.errors import AlreadyExists, ResourceExhausted, ServiceError, Unavailable, error_for_status
from ringserve.message import Load, Logprob, TextDelta, Timings, TokenizedReq

from .io_struct import ChatInput, GenerateInput, GenerateOutput
from .lora import LoraRegistry
from .metrics import ModelMetrics
from .parsers import DEFAULT_TOOL_PARSER, make_reasoning_parser, make_tool_parser
from .parsers.chat_output import ChatOutput, whole_calls
from .parsers.forced_calls import ForcedCallParser
from .request_state import Chunk, ReqState, Wakeup
from .routing import Router, SchedulerView
from .validation import Limits, ModelTokenizer, prepare

log = logging.getLogger(__name__)


class SchedulerLinks(Protocol):
    """What the manager needs from the scheduler connections (scheduler_client.SchedulerPool)."""

    def views(self, in_flight: dict[str, int]) -> list[SchedulerView]: ...
    async def send(self, address: str, reqs: list[TokenizedReq]) -> None: ...
    def abort(self, address: str, rids: list[str]) -> None: ...
    async def flush_cache(self) -> tuple[bool, str]: ...


class TextTokenizerLike(ModelTokenizer, Protocol):
    eos_token_ids: list[int]
    chat_template: str | None

    def token_texts(self, ids: list[int]) -> list[str]: ...


@dataclass
class Call:
    """One Generate call: its samples (n of them) and what its outputs report."""

    rid: str  # the client's
    req: GenerateInput
    states: list[ReqState]
    pending: list[ReqState]  # not finished yet
    arrived: float
    tokenize_s: float
    lora: str = ""           # the adapter its samples hold in the registry's use count until release

    @property
    def done(self) -> bool:
        return not self.pending


@dataclass(frozen=True)
class ManagerSettings:
    owner: str
    limits: Limits
    max_pending_requests: int = 4096
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # for chat requests with tools (tool_choice auto)
    tool_markup_special: bool = False  # the parser's markup is special tokens: keep them in the text
    reasoning_parser: str = ""  # empty: reasoning stays in the text


class TokenizerManager:
    def __init__(self, settings: ManagerSettings, tokenizer: TextTokenizerLike, schedulers: SchedulerLinks,
                 router: Router, detokenizer_up: Callable[[], bool] = lambda: True,
                 weight_version: Callable[[str], str] = lambda address: "default") -> None:
        self.settings = settings
        self.owner = settings.owner
        self.tokenizer = tokenizer
        self.schedulers = schedulers
        self.router = router
        self.detokenizer_up = detokenizer_up
        self.weight_version = weight_version  # of a scheduler address, for each output's meta_info
        self.rid_to_state: dict[str, ReqState] = {}
        self.groups: dict[str, list[ReqState]] = {}  # client rid -> its samples
        self.metrics = ModelMetrics(settings.limits.served_model_name)
        self.lora = LoraRegistry()  # the adapters requests may name (weights: in the schedulers)
        self.ignored_deltas = 0  # deltas for rids no longer (or never) tracked here

    # ---- intake and collection -------------------------------------------------------------

    async def start(self, req: GenerateInput, wakeup: Wakeup) -> Call:
        """Intake: validate, tokenize, register the samples and send them to a scheduler. The
        samples call `wakeup.set()` whenever they have news; `collect` takes it. The caller must
        `release` the call when it stops consuming (also after an error here: nothing to do then)."""
        arrived = time.monotonic()
        rid = req.rid or uuid.uuid4().hex
        if rid in self.groups:
            raise AlreadyExists(f"rid: request {rid!r} is already running")
        lora = self.lora.pick(req.lora_path, req.model, self.settings.limits.served_model_name)
        if lora and req.model == lora:
            req = replace(req, model="")  # vLLM's way: the model field named the adapter, not another model
        t0 = time.perf_counter()
        prepared = prepare(req, self.tokenizer, self.settings.limits)
        tokenize_s = time.perf_counter() - t0
        samplings = prepared.samplings
        if req.chat is not None and req.chat.tool_choice == "auto" and self.settings.tool_markup_special:
            samplings = [replace(sp, skip_special_tokens=False) for sp in samplings]
        n = len(samplings)
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        # Re-check after tokenizing: no await above, but keep the check next to the insert.
        if rid in self.groups or any(r in self.rid_to_state for r in rids):
            raise AlreadyExists(f"rid: request {rid!r} is already running")
        if len(self.rid_to_state) + n > self.settings.max_pending_requests:
            raise ResourceExhausted(f"too many requests in flight ({len(self.rid_to_state)}); retry later")
        if not self.detokenizer_up():
            raise Unavailable("detokenizer unavailable")
        route_key = self.lora.route_prefix(lora) + prepared.input_ids if lora else prepared.input_ids
        address = self.router.select(route_key, self.schedulers.views(self.in_flight()))
        states = [
            ReqState(req=TokenizedReq(rid=r, owner=self.owner, input_ids=prepared.input_ids, sampling=sp,
                                      stream=req.stream, return_logprob=req.return_logprob,
                                      top_logprobs_num=req.top_logprobs_num,
                                      logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                                      lora_name=lora),
                     group=rid, index=i, scheduler=address, event=wakeup, created=arrived,
                     prompt_tokens=len(prepared.input_ids), output=self._chat_output(req.chat))
            for i, (r, sp) in enumerate(zip(rids, samplings))]
        self.groups[rid] = states
        for s in states:
            self.rid_to_state[s.rid] = s
        log.info("rid=%s intake n=%d prompt_tokens=%d stream=%s scheduler=%s%s", rid, n,
                 len(prepared.input_ids), req.stream, address, f" lora={lora}" if lora else "")
        call = Call(rid, req, states, list(states), arrived, tokenize_s, lora)
        if lora:
            self.lora.acquire(lora, 1)
        try:
            await self.schedulers.send(address, [s.req for s in states])
        except BaseException as e:  # also cancellation: forget the states (never reached the scheduler)
            if isinstance(e, ServiceError):
                for s in states:
                    s.fail(e)
            self.release(call)
            raise
        self.metrics.num_requests.inc(n)
        self.metrics.prompt_tokens.inc(n * len(prepared.input_ids))
        return call

    def collect(self, call: Call) -> tuple[list[GenerateOutput], ServiceError | None]:
        """What the call's samples produced since the last look (streamed chunks, finished samples),
        and the error that ends the call, if one did. `call.done` once every sample has finished."""
        outs: list[GenerateOutput] = []
        req = call.req
        for s in list(call.pending):
            if s.error is not None:
                return outs, s.error
            if (s.finished and s.finish is not None and s.finish.type == "abort"
                    and s.finish.status != grpc.StatusCode.OK):
                return outs, error_for_status(s.finish.status, s.finish.message or "aborted")
            # Read `finished` once: more deltas (the last one included) can land while the consumer
            # is suspended, and they must go out in a later chunk.
            finished = s.finished
            if req.stream or finished:
                chunk = s.take()
                if not chunk.empty() or finished:
                    outs.append(self._output(s, chunk, req, call.arrived, call.tokenize_s, finished))
            if finished:
                call.pending.remove(s)
        return outs, None

    async def generate(self, req: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        """One call's outputs as an async stream (a lone Generate call; GenerateStream sessions
        use start / collect / release themselves)."""
        event = asyncio.Event()
        call = await self.start(req, event)
        try:
            while True:
                outs, error = self.collect(call)
                for out in outs:
                    yield out
                if error is not None:
                    raise error
                if call.done:
                    return
                await event.wait()
                event.clear()
        finally:
            self.release(call)

    def _chat_output(self, chat: ChatInput | None) -> ChatOutput | None:
        """A sample's output parsing: tool calls when tools may be called, reasoning when the server
        has a reasoning parser and the request wants it separated. A forced call's output is the
        call itself (JSON from the grammar, no thinking), read by its own parser."""
        if chat is None:
            return None
        if chat.tool_choice in ("function", "required"):
            return ChatOutput(None, ForcedCallParser(chat.tool_name if chat.tool_choice == "function" else None))
        reasoning = make_reasoning_parser(self.settings.reasoning_parser, chat.thinking_enabled) \
            if self.settings.reasoning_parser and chat.separate_reasoning else None
        calls = make_tool_parser(self.settings.tool_call_parser, chat.template_tools or []) \
            if chat.tool_choice == "auto" else None
        return ChatOutput(reasoning, calls) if reasoning is not None or calls is not None else None

    def _output(self, s: ReqState, chunk: Chunk, req: GenerateInput, arrived: float,
                tokenize_s: float, finished: bool) -> GenerateOutput:
        out = GenerateOutput(rid=s.group, index=s.index, text=chunk.text, output_ids=chunk.ids,
                             logprobs=self._with_token_texts(chunk.logprobs) if req.return_logprob else [],
                             finished=finished, prompt_tokens=s.prompt_tokens,
                             completion_tokens=s.num_ids, cached_tokens=s.cached_tokens,
                             input_logprobs=self._with_token_texts(chunk.input_logprobs),
                             weight_version=s.weight_version or self.weight_version(s.scheduler))
        if s.output is not None:
            parsed = s.output.feed(chunk.text, finished)
            out.text, out.reasoning_text = parsed.content, parsed.reasoning
            out.tool_calls = parsed.calls if req.stream else whole_calls(parsed.calls)
        if finished:
            now = time.monotonic()
            out.finish = s.finish
            if s.output is not None and s.output.called and s.finish is not None and s.finish.type == "stop":
                out.finish = replace(s.finish, type="tool_calls")
            out.e2e_latency = now - arrived
            self.metrics.e2e.observe(out.e2e_latency)
            log.info("rid=%s finished reason=%s completion_tokens=%d e2e=%.3fs", s.rid,
                     s.finish.type if s.finish else "?", s.num_ids, out.e2e_latency)
            if req.return_timings:
                # The scheduler's and detokenizer's fields came with the finish; these are ours.
                timings = replace(s.timings or Timings(), tokenize_s=tokenize_s, ring_hops_s=s.ring_hops_s,
                                                         e2e_s=out.e2e_latency)
                if s.first_token_at is not None:
                    timings = replace(timings, ttft_s=s.first_token_at - arrived)
                out.timings = timings
        return out

    def _with_token_texts(self, logprobs: list[Logprob]) -> list[Logprob]:
        if not logprobs:
            return []
        ids = [lp.token_id for lp in logprobs]
        for lp in logprobs:
            ids.extend(t for t, _ in lp.top)
        texts = iter(self.tokenizer.token_texts(ids))
        named = [next(texts) for _ in logprobs]
        return [replace(lp, token=name, top_tokens=tuple(next(texts) for _ in lp.top))
                for lp, name in zip(logprobs, named)]

    def release(self, call: Call) -> None:
        """The call stopped consuming: abort what still runs and forget every sample."""
        rid, states = call.rid, call.states
        running = [s for s in states if not s.finished]
        if running:
            self.metrics.num_aborted.inc(len(running))
            self.schedulers.abort(running[0].scheduler, [s.rid for s in running])
            log.info("rid=%s client gone; aborting %d sample(s)", rid, len(running))
        for s in states:
            if self.rid_to_state.get(s.rid) is s:
                del self.rid_to_state[s.rid]
        if self.groups.get(rid) is states:
            del self.groups[rid]
        if call.lora:  # once: an unload waiting for this adapter's requests may go on
            self.lora.release(call.lora, 1)
            call.lora = ""

    def in_flight(self) -> dict[str, int]:
        return dict(Counter(s.scheduler for s in self.rid_to_state.values()))

    # ---- control ---------------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        """Abort every sample of a client rid; the call ends with finish_reason abort."""
        states = self.groups.get(rid)
        if not states:
            return False
        running = [s for s in states if not s.finished]
        if running:
            self.schedulers.abort(running[0].scheduler, [s.rid for s in running])
            self.metrics.num_aborted.inc(len(running))
        for s in running:
            s.abort("aborted by request")
        log.info("rid=%s aborted by request", rid)
        return True

    def abort_all(self) -> int:
        """Abort every call of this replica (the schedulers' AbortAll ends those of other replicas)."""
        n = 0
        for rid in list(self.groups):
            states = self.groups[rid]
            if any(not s.finished for s in states):
                self.abort(rid)
                n += 1
        return n

    async def flush_cache(self, loads: list[Load]) -> tuple[bool, str]:
        busy = len(self.rid_to_state) + sum(load.num_reqs for load in loads)
        if busy:
            return False, f"refused: {busy} request(s) running or queued"
        return await self.schedulers.flush_cache()

    # ---- events from the ring --------------------------------------------------------------

    def on_deltas(self, deltas: list[TextDelta], hops_s: float = 0.0) -> None:
        """One detokenizer message; `hops_s`: how long its step took from the scheduler to here."""
        now = time.monotonic()
        tokens = 0
        for d in deltas:
            s = self.rid_to_state.get(d.rid)
            if s is None:
                self.ignored_deltas += 1
                continue
            s.ring_hops_s += hops_s
            first, last = s.first_token_at, s.last_token_at
            new_ids = s.apply(d, now)
            if new_ids:
                tokens += new_ids
                if first is None:
                    self.metrics.ttft.observe(now - s.created)
                elif last is not None:
                    self.metrics.itl.observe((now - last) / new_ids)
            s.event.set()
        if tokens:
            self.metrics.generation_tokens.inc(tokens)  # once per message, not per request

    def on_rejection(self, rid: str, status: grpc.StatusCode, message: str) -> None:
        s = self.rid_to_state.get(rid)
        if s is not None:
            log.info("rid=%s rejected by scheduler status=%s: %s", rid, status.name, message)
            s.fail(error_for_status(status, message))

    def on_scheduler_down(self, address: str) -> None:
        """Its stream broke: the scheduler has dropped our requests, so end them now."""
        self.router.forget(address)
        failed = 0
        for s in self.rid_to_state.values():
            if s.scheduler == address and not s.finished:
                s.fail(Unavailable(f"scheduler {address} unavailable"))
                failed += 1
        if failed:
            log.warning("scheduler %s down: failed %d in-flight request(s)", address, failed)

    def fail_all(self, error: ServiceError) -> None:
        """End every in-flight request (no detokenizer for longer than the grace period)."""
        by_scheduler: dict[str, list[str]] = {}
        for s in self.rid_to_state.values():
            if not s.finished:
                by_scheduler.setdefault(s.scheduler, []).append(s.rid)
                s.fail(error)
        for address, rids in by_scheduler.items():
            self.schedulers.abort(address, rids)
        if by_scheduler:
            log.warning("failed %d in-flight request(s): %s", sum(map(len, by_scheduler.values())), error.message)
