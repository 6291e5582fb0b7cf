"""One internal request (one sample) as the tokenizer sends it to a scheduler: validated, tokenized,
its sampling parameters resolved."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.message.sampling import SamplingParams
from ringserve.v1 import scheduler_pb2


@dataclass(frozen=True)
class TokenizedReq:
    rid: str
    owner: str                      # the tokenizer replica its outputs go to
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1     # score the prompt from this position on (-1: no)
    sent_at: float = 0.0            # unix time the tokenizer sent it (the hop's timing)
    lora_name: str = ""             # a LoRA adapter loaded on every scheduler ("": the base model)

    def to_pb(self, sent_at: float) -> scheduler_pb2.TokenizedRequest:
        return scheduler_pb2.TokenizedRequest(
            rid=self.rid, owner=self.owner, input_ids=self.input_ids, sampling_params=self.sampling.to_pb(),
            stream=self.stream, return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
            sent_at=sent_at, logprob_start_len=self.logprob_start_len if self.logprob_start_len >= 0 else None,
            lora_name=self.lora_name)

    @classmethod
    def from_pb(cls, pb: scheduler_pb2.TokenizedRequest) -> TokenizedReq:
        return cls(rid=pb.rid, owner=pb.owner, input_ids=list(pb.input_ids),
                   sampling=SamplingParams.from_pb(pb.sampling_params), stream=pb.stream,
                   return_logprob=pb.return_logprob, top_logprobs_num=pb.top_logprobs_num,
                   logprob_start_len=pb.logprob_start_len if pb.HasField("logprob_start_len") else -1,
                   sent_at=pb.sent_at, lora_name=pb.lora_name)
