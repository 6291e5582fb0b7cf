"""SGLang's scheduler protocol (`sglang.grpc.scheduler`, from PyPI smg-grpc-proto) <-> our types.

In: a `GenerateRequest` becomes a checked `GenerateCall` (the prompt ids, one resolved SamplingParams
per sample) and then one `Req` per sample. Out: a request's `TokenDelta`s become `GenerateStreamChunk`s
(new ids, cumulative counts, logprobs) and one `GenerateComplete` (finish reason, matched stop).

The semantics follow SGLang's own servicer: the sampling fields are plain proto3 scalars that the
gateway fills explicitly (repetition_penalty 0 means 1); `max_new_tokens` unset means the rest of the
context, and one past the context is capped to it (SGLang's scheduler does both); prompt logprobs
only with return_logprob. Whatever this scheduler cannot honour is INVALID_ARGUMENT naming the field,
never silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb2

from ringserve.errors import InvalidArgument
from ringserve.message import Finish, Logprob, SamplingParams, TokenDelta
from ringserve.sampling_checks import check_sampling
from services.scheduler.core.req import Req

# The constraint oneof -> our SamplingParams field (structural_tag has none: refused).
CONSTRAINT_FIELDS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf"}


@dataclass(frozen=True)
class Limits:
    """Bounds on one request (the same as the tokenizer's defaults)."""

    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_len: int = 256
    max_top_logprobs: int = 20


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    max_seq_len: int      # prompt + output tokens one request can hold (context length and KV pool)


@dataclass(frozen=True)
class GenerateCall:
    """One checked Generate request: the prompt and each sample's parameters."""

    request_id: str
    input_ids: list[int]
    samplings: list[SamplingParams]
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int

    @property
    def n(self) -> int:
        return len(self.samplings)

    @classmethod
    def from_pb(cls, pb: pb2.GenerateRequest, facts: ModelFacts, limits: Limits = Limits()) -> GenerateCall:
        if not pb.request_id:
            raise InvalidArgument("request_id", "required")
        _refuse_unsupported(pb)
        if not pb.HasField("tokenized") or not pb.tokenized.input_ids:
            raise InvalidArgument("tokenized.input_ids", "required (this scheduler takes token ids only)")
        ids = list(pb.tokenized.input_ids)
        for i, t in enumerate(ids):
            if t >= facts.vocab_size:
                raise InvalidArgument("tokenized.input_ids", f"id {t} at position {i} is outside "
                                                             f"[0, {facts.vocab_size})")
        room = facts.max_seq_len - len(ids)
        if room <= 0:
            raise InvalidArgument("tokenized.input_ids", f"the prompt has {len(ids)} tokens; this scheduler "
                                                         f"holds at most {facts.max_seq_len - 1}")
        if pb.top_logprobs_num < 0 or pb.top_logprobs_num > limits.max_top_logprobs:
            raise InvalidArgument("top_logprobs_num", f"must be in [0, {limits.max_top_logprobs}], "
                                                      f"got {pb.top_logprobs_num}")
        start = pb.logprob_start_len if pb.return_logprob else -1
        if not -1 <= start < len(ids):
            raise InvalidArgument("logprob_start_len", f"must be -1 (none) or a prompt position "
                                                       f"(< {len(ids)}), got {start}")
        sp = sampling_from_pb(pb.sampling_params, room, facts.vocab_size, limits)
        samplings = [sp.resolve(sp.max_tokens, i) for i in range(sp.n)]
        return cls(request_id=pb.request_id, input_ids=ids, samplings=samplings,
                   stream=pb.stream, return_logprob=pb.return_logprob, top_logprobs_num=pb.top_logprobs_num,
                   logprob_start_len=start)

    def reqs(self, rids: list[str], owner: str) -> list[Req]:
        """The scheduler's requests, one per sample (rids[i] for sample i)."""
        return [Req(rid=rid, origin_input_ids=list(self.input_ids), params=sp, owner=owner, stream=self.stream,
                    return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
                    logprob_start_len=self.logprob_start_len)
                for rid, sp in zip(rids, self.samplings, strict=True)]


def _refuse_unsupported(pb: pb2.GenerateRequest) -> None:
    """Fields that ask for something this scheduler does not do. `timestamp` and `log_metrics` are
    bookkeeping with nothing to honour; `original_text` is only for reference."""
    if pb.HasField("mm_inputs"):
        raise InvalidArgument("mm_inputs", "multimodal input is not supported (text models only)")
    if len(pb.input_embeds):
        raise InvalidArgument("input_embeds", "not supported; send tokenized.input_ids")
    if pb.return_hidden_states:
        raise InvalidArgument("return_hidden_states", "not supported")
    if pb.HasField("disaggregated_params"):
        raise InvalidArgument("disaggregated_params", "prefill/decode disaggregation is not supported")
    if pb.custom_logit_processor:
        raise InvalidArgument("custom_logit_processor", "not supported (use sampling_params.logit_bias)")
    if pb.lora_id:
        raise InvalidArgument("lora_id", "LoRA adapters are not served through this port")
    if len(pb.token_ids_logprob):
        raise InvalidArgument("token_ids_logprob", "not supported (use top_logprobs_num)")
    if pb.HasField("data_parallel_rank") and pb.data_parallel_rank != 0:
        raise InvalidArgument("data_parallel_rank", f"this scheduler is rank 0 only, got {pb.data_parallel_rank}")
    if pb.require_reasoning:
        raise InvalidArgument("require_reasoning", "reasoning tokens are not counted by this scheduler")


def sampling_from_pb(sp: pb2.SamplingParams, room: int, vocab_size: int, limits: Limits) -> SamplingParams:
    """Our SamplingParams, checked; max_new_tokens resolved against the `room` the prompt leaves."""
    constraint: dict[str, str] = {}
    which = sp.WhichOneof("constraint")
    if which == "structural_tag":
        raise InvalidArgument("sampling_params.structural_tag",
                              "not supported by this scheduler's grammar backend (use json_schema, regex or "
                              "ebnf_grammar)")
    if which is not None:
        constraint[CONSTRAINT_FIELDS[which]] = getattr(sp, which)
    if sp.HasField("custom_params") and sp.custom_params.fields:
        raise InvalidArgument("sampling_params.custom_params", "not supported (no custom logit processors)")
    bias: list[tuple[int, float]] = []
    for key, value in sp.logit_bias.items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise InvalidArgument("sampling_params.logit_bias", f"key {key!r} is not a token id") from None
    mnt = min(sp.max_new_tokens, room) if sp.HasField("max_new_tokens") else room
    if sp.min_new_tokens > mnt:
        raise InvalidArgument("sampling_params.min_new_tokens", f"{sp.min_new_tokens} is more than max_new_tokens "
                                                                f"({mnt}, after capping to the context)")
    out = SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0, max_new_tokens=mnt, min_new_tokens=sp.min_new_tokens,
        stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens, spaces_between_special_tokens=sp.spaces_between_special_tokens,
        n=sp.n or 1, no_stop_trim=sp.no_stop_trim, logit_bias=tuple(sorted(bias)),
        regex=constraint.get("regex"), json_schema=constraint.get("json_schema"), ebnf=constraint.get("ebnf"))
    check_sampling(out, vocab_size, limits)
    return out


# -- out ---------------------------------------------------------------------------------------------

def _output_logprobs(lps: list[Logprob], top: bool) -> pb2.OutputLogProbs:
    return pb2.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps], token_ids=[lp.token_id for lp in lps],
        top_logprobs=[pb2.TopLogProbs(values=[p for _, p in lp.top], token_ids=[t for t, _ in lp.top])
                      for lp in lps] if top else [])


def _input_logprobs(lps: list[Logprob], top: bool) -> pb2.InputLogProbs:
    # The first prompt position has no logprob (nan here, an unset value there).
    return pb2.InputLogProbs(
        token_logprobs=[pb2.InputTokenLogProb() if math.isnan(lp.logprob) else pb2.InputTokenLogProb(value=lp.logprob)
                        for lp in lps],
        token_ids=[lp.token_id for lp in lps],
        top_logprobs=[pb2.TopLogProbs(values=[p for _, p in lp.top], token_ids=[t for t, _ in lp.top])
                      for lp in lps] if top else [])


def chunk_pb(call: GenerateCall, index: int, d: TokenDelta) -> pb2.GenerateResponse:
    """A streaming chunk: the ids new since the last one; counts so far."""
    top = call.top_logprobs_num > 0
    chunk = pb2.GenerateStreamChunk(token_ids=d.ids, prompt_tokens=len(call.input_ids),
                                    completion_tokens=d.offset + len(d.ids), cached_tokens=d.cached_tokens,
                                    index=index)
    if call.return_logprob:
        chunk.output_logprobs.CopyFrom(_output_logprobs(d.logprobs, top))
    if d.input_logprobs:
        chunk.input_logprobs.CopyFrom(_input_logprobs(d.input_logprobs, top))
    return pb2.GenerateResponse(request_id=call.request_id, chunk=chunk)


def finish_reason(f: Finish) -> str:
    return f.type if f.type in ("stop", "length", "abort") else "stop"


def complete_pb(call: GenerateCall, index: int, d: TokenDelta) -> pb2.GenerateResponse:
    """The last message of one sample. Its ids are those of its last delta, as in SGLang: all of them
    when not streaming, the last chunk's when streaming."""
    assert d.finish is not None
    top = call.top_logprobs_num > 0
    done = pb2.GenerateComplete(output_ids=d.ids, finish_reason=finish_reason(d.finish),
                                prompt_tokens=len(call.input_ids), completion_tokens=d.offset + len(d.ids),
                                cached_tokens=d.cached_tokens, index=index)
    if d.finish.matched_token is not None:
        done.matched_token_id = d.finish.matched_token
    elif d.finish.matched_str is not None:
        done.matched_stop_str = d.finish.matched_str
    if call.return_logprob:
        done.output_logprobs.CopyFrom(_output_logprobs(d.logprobs, top))
    if d.input_logprobs:
        done.input_logprobs.CopyFrom(_input_logprobs(d.input_logprobs, top))
    return pb2.GenerateResponse(request_id=call.request_id, complete=done)
