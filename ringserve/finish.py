"""Why a request ended: the one plain mirror of the proto FinishReason, shared by the services.

The scheduler decides it, the detokenizer trims text by it, the tokenizer reports it; all three
convert it at their edges with these two functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Finish:
    type: str                         # "stop" | "length" | "abort"
    matched_token: int | None = None
    matched_str: str | None = None
    message: str = ""
    status_code: int = 0              # google.rpc.Code for aborts; 0 is a clean abort


def finish_to_pb(f: Finish) -> common_pb2.FinishReason:
    pb = common_pb2.FinishReason(type=f.type, message=f.message, status_code=f.status_code)
    if f.matched_token is not None:
        pb.matched_token = f.matched_token
    elif f.matched_str is not None:
        pb.matched_str = f.matched_str
    return pb


def finish_from_pb(pb: common_pb2.FinishReason) -> Finish:
    which = pb.WhichOneof("matched")
    return Finish(type=pb.type or "stop",
                  matched_token=pb.matched_token if which == "matched_token" else None,
                  matched_str=pb.matched_str if which == "matched_str" else None,
                  message=pb.message, status_code=pb.status_code)
