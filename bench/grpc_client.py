"""Load on the tokenizer's public gRPC API: InferenceService.Generate, streaming, prompt as input_ids.

Each request asks for `return_timings`, so the record carries the server's own account of where its
time went (tokenize, queue, prefill, decode, the ring's hops, detokenize) for the report.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc

from bench.loadgen import drive
from bench.model_info import vocab
from bench.stats import RequestRecord, StreamTimer
from bench.workloads import Workload, make_prompts


async def _run(w: Workload, target: str, prompts: list[list[int]], warmup: bool) -> tuple[list[RequestRecord], float]:
    from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2

    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        await asyncio.wait_for(ch.channel_ready(), 30)
        stub = api_pb2_grpc.InferenceServiceStub(ch)

        async def send(i: int) -> RequestRecord:
            ids = prompts[i]
            req = api_pb2.GenerateRequest(
                rid=f"bench-{uuid.uuid4().hex[:12]}", input_ids=api_pb2.TokenIds(ids=ids), stream=True,
                return_timings=True,
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=w.output_len,
                                                          ignore_eos=True))
            timer = StreamTimer(time.perf_counter())
            timings: dict[str, float] = {}
            try:
                async for resp in stub.Generate(req, timeout=1800):
                    timer.chunk(time.perf_counter(), len(resp.output_ids))
                    if resp.finished and resp.meta_info.HasField("timings"):
                        timings = {f.name: v for f, v in resp.meta_info.timings.ListFields()}
            except grpc.aio.AioRpcError as e:
                return RequestRecord(ok=False, prompt_len=len(ids), error=f"{e.code().name}: {e.details()}")
            rec = timer.record(len(ids), time.perf_counter())
            rec.timings = timings
            return rec

        return await drive(w, send, warmup)


def run(w: Workload, target: str, model_dir: Path, warmup: bool = True) -> tuple[list[RequestRecord], float]:
    size, special = vocab(model_dir)
    return asyncio.run(_run(w, target, make_prompts(w, size, special), warmup))
