"""A small blocking client of the public gRPC API for end-to-end tests."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc

from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2


@dataclass
class StreamResult:
    """What one streamed Generate call delivered."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_type: str = ""
    error: grpc.StatusCode | None = None
    error_message: str = ""
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def generate_request(text: str, max_new_tokens: int, *, stream: bool = True, rid: str = "",
                     **params: object) -> api_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for k, v in params.items():
        setattr(sp, k, v)
    return api_pb2.GenerateRequest(rid=rid, text=text, stream=stream, sampling_params=sp)


def stream_generate(stub: api_pb2_grpc.InferenceServiceStub, req: api_pb2.GenerateRequest,
                    result: StreamResult, timeout: float = 120) -> None:
    """Run one streaming Generate call to completion, filling `result` (for a thread)."""
    try:
        for msg in stub.Generate(req, timeout=timeout):
            result.text += msg.text
            result.output_ids.extend(msg.output_ids)
            if msg.output_ids:
                result.first_token.set()
            if msg.finished:
                result.finish_type = msg.meta_info.finish_reason.type
    except grpc.RpcError as e:
        result.error = e.code()
        result.error_message = e.details() or ""
    finally:
        result.first_token.set()
        result.done.set()


def start_streams(stub: api_pb2_grpc.InferenceServiceStub, reqs: list[api_pb2.GenerateRequest],
                  timeout: float = 120) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in reqs]
    threads = [threading.Thread(target=stream_generate, args=(stub, r, res, timeout), daemon=True)
               for r, res in zip(reqs, results)]
    for t in threads:
        t.start()
    return results, threads


def server_info(stub: api_pb2_grpc.InferenceServiceStub) -> api_pb2.GetServerInfoResponse:
    return stub.GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=10)
