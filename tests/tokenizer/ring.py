"""A background event loop that hosts the fakes and in-process tokenizer servers for sync tests.

Tests talk to the tokenizer through ordinary (sync) gRPC stubs, like any client would; the servers
run in the loop thread. `Ring` owns every server it starts and stops them all in `close()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from ringserve.process import free_port
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2_grpc, detokenizer_pb2_grpc, scheduler_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import TokenizerServer

from .fakes import FakeDetokenizer, FakeScheduler, FakeSchedulerOptions, Recorder

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        # Signal handlers can only be installed from the main thread; servers started here are
        # stopped by the test, not by signals.
        self.loop.add_signal_handler = lambda *args, **kwargs: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class Ring:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.tokenizer = TextTokenizer.from_model(model_dir)
        self.lt = LoopThread()
        self.recorder = Recorder()
        self.options = FakeSchedulerOptions()
        self.detok = FakeDetokenizer(self.recorder)
        self.detok_port = free_port()
        self.detok_server = self.lt.run(self._start_server(self.detok_port, lambda s: (
            detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(self.detok, s))))
        self.schedulers: dict[int, grpc.aio.Server] = {}
        self.tokenizers: list[TokenizerServer] = []

    @staticmethod
    async def _start_server(port: int, add: Any) -> grpc.aio.Server:
        server = grpc.aio.server()
        add(server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        return server

    def start_scheduler(self, port: int | None = None) -> int:
        port = port or free_port()
        fake = FakeScheduler(self.detok, self.recorder, self.options)
        self.schedulers[port] = self.lt.run(self._start_server(port, lambda s: (
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, s))))
        return port

    def kill_scheduler(self, port: int) -> None:
        server = self.schedulers.pop(port)
        self.lt.run(server.stop(None))

    def tokenizer_args(self, scheduler_ports: list[int]) -> list[str]:
        args = ["--model", self.model_dir, "--detokenizer", f"127.0.0.1:{self.detok_port}"]
        for p in scheduler_ports:
            args += ["--scheduler", f"127.0.0.1:{p}"]
        return args

    def start_tokenizer(self, scheduler_ports: list[int], **overrides: Any) -> TokenizerServer:
        values: dict[str, Any] = dict(port=free_port(), metrics_port=-1, model=self.model_dir,
                                      scheduler=tuple(f"127.0.0.1:{p}" for p in scheduler_ports),
                                      detokenizer=(f"127.0.0.1:{self.detok_port}",), drain_grace_s=0.0)
        values.update(overrides)
        server = self.lt.run(self._start_tokenizer(TokenizerConfig(**values)))
        self.tokenizers.append(server)
        return server

    async def _start_tokenizer(self, cfg: TokenizerConfig) -> TokenizerServer:
        server = TokenizerServer(cfg, tokenizer=self.tokenizer)  # grpc.aio binds to the running loop
        await server.start()
        return server

    def close(self) -> None:
        for t in self.tokenizers:
            self.lt.run(t.stop(0))
        for s in list(self.schedulers.values()):
            self.lt.run(s.stop(None))
        self.lt.run(self.detok_server.stop(None))
        self.lt.close()


def stub(server: TokenizerServer) -> tuple[grpc.Channel, api_pb2_grpc.InferenceServiceStub]:
    channel = grpc.insecure_channel(server.cfg.address)
    return channel, api_pb2_grpc.InferenceServiceStub(channel)
