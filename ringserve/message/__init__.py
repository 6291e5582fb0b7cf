"""The one vocabulary of what crosses a service boundary.

Each concept that travels between services has exactly one Python type here, and that type owns its
conversion to and from protobuf (`from_pb` / `to_pb`), as TGI's `Batch.from_pb` does. Services
work with these types and convert only at their gRPC edge. Defaults are resolved once, at intake in
the tokenizer (`SamplingParams.resolve`); every later hop reads resolved values.

| type            | travels                                           | proto                      |
|-----------------|---------------------------------------------------|----------------------------|
| SamplingParams  | client -> tokenizer -> scheduler -> detokenizer   | common.SamplingParams      |
| Finish          | scheduler -> detokenizer -> tokenizer -> client   | common.FinishReason        |
| Logprob         | scheduler -> detokenizer -> tokenizer -> client   | common.TokenLogprob        |
| Timings         | every hop adds its part                           | common.Timings             |
| Load            | scheduler -> tokenizer (routing, server info)     | scheduler.LoadReport       |
| TokenizedReq    | tokenizer -> scheduler                            | scheduler.TokenizedRequest |
| DecodeParams, TokenDelta, StepBatch | scheduler -> detokenizer      | detokenizer.*              |
| TextDelta       | detokenizer -> tokenizer                          | detokenizer.TextDelta      |
| LoraAdapter     | client -> tokenizer -> scheduler; scheduler info  | common.LoraAdapter         |
"""

from ringserve.message.deltas import DecodeParams, StepBatch, TextDelta, TokenDelta
from ringserve.message.finish import Finish
from ringserve.message.load import Load
from ringserve.message.logprob import Logprob
from ringserve.message.lora import LoraAdapter
from ringserve.message.request import TokenizedReq
from ringserve.message.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from ringserve.message.timings import Timings

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DecodeParams", "Finish", "Load", "Logprob", "LoraAdapter", "SamplingParams",
           "StepBatch", "TextDelta", "Timings", "TokenDelta", "TokenizedReq"]
