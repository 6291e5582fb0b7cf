"""Fixtures of the tokenizer tests: a Ring (fakes + one in-process tokenizer) and a client stub."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from ringserve.process import wait_grpc_serving
from ringserve.v1 import api_pb2_grpc

from .ring import Ring


@pytest.fixture
def ring(model_dir: str) -> Iterator[Ring]:
    r = Ring(model_dir)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def tokenizer(ring: Ring):  # -> TokenizerServer
    port = ring.start_scheduler()
    server = ring.start_tokenizer([port])
    wait_grpc_serving(server.cfg.address, timeout=10)
    return server


@pytest.fixture
def client(tokenizer) -> Iterator[api_pb2_grpc.InferenceServiceStub]:
    with grpc.insecure_channel(tokenizer.cfg.address) as channel:
        yield api_pb2_grpc.InferenceServiceStub(channel)

