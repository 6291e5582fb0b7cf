"""The detokenizer core: rid -> request state, one step of token deltas in, text deltas per owner out.

Knows nothing of gRPC: it works on the shared `ringserve.message` types, and the servicer converts
at the edge (`StepBatch.from_pb` in, `OwnerBatch.to_pb` out). Per step it
  1. folds each TokenDelta into its request's state (new, resync, dedup by offset, unknown rid),
  2. decodes the new ids of every request in the step with batched decode calls,
  3. gates the text through the request's stop-string (and stop_regex) trimmer,
  4. groups the resulting TextDeltas by owner (one OwnerBatch per owner per step),
and frees a request's state as soon as it finishes or is aborted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from ringserve.message import DecodeParams, Logprob, StepBatch, TextDelta, Timings, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import detokenizer_pb2
from services.detokenizer.decode_state import DecodeJob, DecodeState, IncrementalDecoder
from services.detokenizer.stop_trim import StopTrimmer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OwnerBatch:
    """The text deltas of one step for one tokenizer replica: one SubscribeResponse's worth."""

    owner: str
    deltas: list[TextDelta]
    step_sent_at: float = 0.0

    def to_pb(self) -> detokenizer_pb2.SubscribeResponse:
        resp = detokenizer_pb2.SubscribeResponse(step_sent_at=self.step_sent_at)
        for d in self.deltas:
            d.add_to(resp)
        return resp


@dataclass(slots=True)
class RequestState:
    """Everything the detokenizer keeps for one running request."""

    rid: str
    params: DecodeParams
    decode: DecodeState
    stop: StopTrimmer
    n_ids: int = 0  # output ids received so far
    n_chars: int = 0  # code points sent so far (text_offset of the next delta)
    decode_s: float = 0.0  # share of step decode time attributed to this request
    # Non-streaming requests: what accumulates until the single delta at finish.
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[Logprob] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    pending_input_logprobs: list[Logprob] = field(default_factory=list)


@dataclass(slots=True)
class StepStats:
    decode_s: float = 0.0
    tokens: int = 0
    deltas_dropped: int = 0


class Detokenizer:
    """rid_to_state plus the per-step pipeline."""

    def __init__(self, tokenizer: TextTokenizer, max_tracked_requests: int = 65536) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.max_tracked_requests = max_tracked_requests
        self.states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def step(self, batch: StepBatch) -> tuple[list[OwnerBatch], StepStats]:
        stats = StepStats()
        work: list[tuple[RequestState, TokenDelta, list[int]]] = []
        for delta in batch.deltas:
            st, new_ids = self._fold(delta, batch.resync)
            if st is None:
                stats.deltas_dropped += 1
                continue
            work.append((st, delta, new_ids))
        t0 = time.perf_counter()
        texts = self.decoder.step([DecodeJob(st.decode, d.finish is not None) for st, d, _ in work])
        stats.decode_s = time.perf_counter() - t0
        share = stats.decode_s / len(work) if work else 0.0
        by_owner: dict[str, list[TextDelta]] = {}
        for (st, delta, new_ids), text in zip(work, texts):
            st.decode_s += share
            stats.tokens += len(new_ids)
            out = self._emit(st, delta, new_ids, text)
            if out is not None:
                by_owner.setdefault(st.params.owner, []).append(out)
        return [OwnerBatch(o, ds, batch.sent_at) for o, ds in by_owner.items()], stats

    # -- folding deltas into state ---------------------------------------------------------

    def _fold(self, delta: TokenDelta, resync: bool) -> tuple[RequestState | None, list[int]]:
        """The request's state with the delta's new ids appended (None: drop the delta)."""
        st = self.states.get(delta.rid)
        if delta.params is not None and delta.offset == 0 and (st is None or resync or st.n_ids > 0):
            # First delta, or a resync: (re)build from scratch; the tokenizer dedups by offset.
            if st is None and len(self.states) >= self.max_tracked_requests:
                log.warning("rid=%s dropped: max tracked requests (%d) reached; raise "
                            "--max-tracked-requests or resync later", delta.rid, self.max_tracked_requests)
                return None, []
            st = self._new_state(delta.rid, delta.params)
            self.states[delta.rid] = st
        elif st is None:
            log.warning("rid=%s delta for unknown request without params dropped (offset=%d)",
                        delta.rid, delta.offset)
            return None, []
        ids = delta.ids
        if delta.offset < st.n_ids:  # overlap with what we have: keep only the new part
            ids = ids[st.n_ids - delta.offset:]
        elif delta.offset > st.n_ids:
            log.warning("rid=%s gap in ids (have %d, delta at %d): dropped until resync",
                        delta.rid, st.n_ids, delta.offset)
            return None, []
        st.n_ids += len(ids)
        decode_ids = ids
        fin = delta.finish
        if (fin is not None and fin.matched_token is not None and not st.params.sampling.no_stop_trim
                and ids and ids[-1] == fin.matched_token):
            decode_ids = ids[:-1]  # the stop token's text is not part of the output
        st.decode.append(decode_ids)
        return st, ids

    def _new_state(self, rid: str, params: DecodeParams) -> RequestState:
        # spaces_between_special_tokens is not read: fast (Rust) tokenizers ignore it, as
        # transformers' and vLLM's fast paths do; it travels in SamplingParams for the API only.
        sp = params.sampling
        return RequestState(rid=rid, params=params, decode=self.decoder.new_state(sp.skip_special_tokens),
                            stop=StopTrimmer(sp.stop, sp.no_stop_trim, sp.stop_regex))

    # -- emitting text ---------------------------------------------------------------------

    def _emit(self, st: RequestState, delta: TokenDelta, ids: list[int], text: str) -> TextDelta | None:
        fin = delta.finish
        if fin is None:
            text = st.stop.feed(text)
        else:
            text = st.stop.finish(text, fin.matched_str, st.rid, fin.trim_chars)
            self.states.pop(st.rid, None)
        token_offset = st.n_ids - len(ids)
        input_logprobs = delta.input_logprobs
        if not st.params.stream:
            st.pending_ids.extend(ids)
            st.pending_logprobs.extend(delta.logprobs)
            st.pending_text.append(text)
            if input_logprobs:
                st.pending_input_logprobs = input_logprobs
            if fin is None:
                return None
            ids, token_offset, text = st.pending_ids, 0, "".join(st.pending_text)
            logprobs, input_logprobs = st.pending_logprobs, st.pending_input_logprobs
        else:
            logprobs = delta.logprobs
        # Non-streaming text is all of the output; streaming text starts where the last delta ended.
        text_offset = st.n_chars if st.params.stream else 0
        st.n_chars = text_offset + len(text)
        timings: Timings | None = None
        if fin is not None:
            # Timings travel on the last delta only: the scheduler's, plus this service's decode share.
            timings = replace(delta.timings or Timings(), detokenize_s=st.decode_s)
            log.debug("rid=%s finished (%s): %d ids, %d chars", st.rid, fin.type, st.n_ids, st.n_chars)
        # Positional, in field order: once per request per step.
        return TextDelta(st.rid, token_offset, ids, text_offset, text, logprobs, fin, st.params.prompt_tokens,
                         delta.cached_tokens, timings, input_logprobs, delta.weight_version)
