"""Why a request ended. The scheduler decides it, the detokenizer trims text by it, the tokenizer
reports it (an abort with a status ends the client's call with that status)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from ringserve.errors import status_of
from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Finish:
    type: str                         # "stop" | "length" | "abort"
    matched_token: int | None = None
    matched_str: str | None = None
    message: str = ""
    status: grpc.StatusCode = grpc.StatusCode.OK  # for aborts: how the call ends; OK is a clean abort
    trim_chars: int | None = None     # a stop_regex finish: characters to cut from the end of the text

    @classmethod
    def abort(cls, status: grpc.StatusCode, message: str) -> Finish:
        return cls("abort", message=message, status=status)

    def to_pb(self) -> common_pb2.FinishReason:
        pb = common_pb2.FinishReason(type=self.type, message=self.message, status_code=self.status.value[0])
        if self.matched_token is not None:
            pb.matched_token = self.matched_token
        elif self.matched_str is not None:
            pb.matched_str = self.matched_str
        if self.trim_chars is not None:
            pb.trim_chars = self.trim_chars
        return pb

    @classmethod
    def from_pb(cls, pb: common_pb2.FinishReason) -> Finish:
        which = pb.WhichOneof("matched")
        return cls(type=pb.type or "stop",
                   matched_token=pb.matched_token if which == "matched_token" else None,
                   matched_str=pb.matched_str if which == "matched_str" else None,
                   message=pb.message, status=status_of(pb.status_code),
                   trim_chars=pb.trim_chars if pb.HasField("trim_chars") else None)
