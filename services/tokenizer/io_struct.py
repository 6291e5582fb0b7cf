"""The tokenizer's own public-API types, each owning its protobuf conversion (as TGI's `from_pb`/`to_pb`).

Named after SGLang's io_struct: what comes in (GenerateInput, ChatInput) and what goes out
(GenerateOutput). What travels inside the ring (sampling parameters, TokenizedReq, TextDelta, Finish,
Logprob, Timings, Load) is ringserve.message's, not redeclared here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.message import Finish, Logprob, SamplingParams, Timings
from ringserve.v1 import api_pb2


@dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def from_pb(cls, pb: api_pb2.ChatInput) -> ChatInput:
        return cls(messages=[{"role": m.role, "content": m.content} for m in pb.messages],
                   add_generation_prompt=pb.add_generation_prompt if pb.HasField("add_generation_prompt") else True,
                   continue_final_message=pb.continue_final_message)


@dataclass(frozen=True)
class GenerateInput:
    """One Generate call. Exactly one of text / input_ids / chat should be set (validation checks).

    `sampling` is the client's: unset fields hold the defaults, except max_new_tokens (None until
    validation resolves it against the prompt and the context length)."""

    rid: str = ""
    text: str | None = None
    input_ids: list[int] | None = None
    chat: ChatInput | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_timings: bool = False
    model: str = ""
    logprob_start_len: int = -1  # with return_logprob: score the prompt from here (-1: no)

    @classmethod
    def from_pb(cls, pb: api_pb2.GenerateRequest) -> GenerateInput:
        which = pb.WhichOneof("input")
        return cls(
            rid=pb.rid, text=pb.text if which == "text" else None,
            input_ids=list(pb.input_ids.ids) if which == "input_ids" else None,
            chat=ChatInput.from_pb(pb.chat) if which == "chat" else None,
            sampling=SamplingParams.from_pb(pb.sampling_params), stream=pb.stream,
            return_logprob=pb.return_logprob, top_logprobs_num=pb.top_logprobs_num,
            return_timings=pb.return_timings, model=pb.model,
            logprob_start_len=pb.logprob_start_len if pb.HasField("logprob_start_len") else -1)


@dataclass
class GenerateOutput:
    """One message of a Generate stream."""

    rid: str
    index: int
    text: str
    output_ids: list[int]
    logprobs: list[Logprob]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_logprobs: list[Logprob] = field(default_factory=list)  # the prompt's, on the first output
    finish: Finish | None = None
    e2e_latency: float = 0.0
    timings: Timings | None = None  # with return_timings, on the last output

    def to_pb(self) -> api_pb2.GenerateResponse:
        meta = api_pb2.MetaInfo(id=self.rid, prompt_tokens=self.prompt_tokens,
                                completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens)
        if self.finished:
            if self.finish is not None:
                meta.finish_reason.CopyFrom(self.finish.to_pb())
            meta.e2e_latency = self.e2e_latency
            if self.timings is not None:
                meta.timings.CopyFrom(self.timings.to_pb())
        return api_pb2.GenerateResponse(rid=self.rid, index=self.index, text=self.text, output_ids=self.output_ids,
                                        logprobs=Logprob.list_to_pb(self.logprobs), finished=self.finished,
                                        meta_info=meta, input_logprobs=Logprob.list_to_pb(self.input_logprobs))
