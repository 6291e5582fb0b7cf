"""Services die and come back under load; clients see complete streams or a clear error, never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.process import wait_grpc_serving
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2_grpc
from tests.e2e.grpc_client import generate_request, server_info, start_streams
from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.e2e


def kill_and_wait_restart(stack: Stack, module: str) -> None:
    old = stack.service_pid(module)
    mark = stack.launcher.lines_seen
    os.kill(old, signal.SIGKILL)
    stack.launcher.wait_output(f"{module.rsplit('.', 1)[-1]} back", timeout=90, after=mark)


def watch_health(target: str, seen: list[int]) -> None:
    """Record the tokenizer's health statuses until it has gone NOT_SERVING and back to SERVING."""
    with grpc.insecure_channel(target) as ch:
        for resp in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60):
            seen.append(resp.status)
            if resp.status == health_pb2.HealthCheckResponse.SERVING and \
                    health_pb2.HealthCheckResponse.NOT_SERVING in seen:
                return


def test_detokenizer_killed_mid_stream_loses_nothing(model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    with running_stack(model_dir) as stack, grpc.insecure_channel(stack.tokenizer) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)
        reqs = [generate_request(f"stream {i} 你好", 160) for i in range(8)]
        results, threads = start_streams(stub, reqs)
        for r in results:
            assert r.first_token.wait(60)
        kill_and_wait_restart(stack, "services.detokenizer")
        for t in threads:
            t.join(120)
        for r in results:
            assert r.error is None, (r.error, r.error_message, stack.timeline())
            assert len(r.output_ids) == 160
            assert r.text == tok.decode(r.output_ids)
            assert r.finish_type == "length"
        assert server_info(stub).rid_to_state_size == 0


def test_scheduler_killed_mid_stream_fails_fast_then_recovers(model_dir: str) -> None:
    with running_stack(model_dir) as stack, grpc.insecure_channel(stack.tokenizer) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)
        tokenizer_pid = stack.service_pid("services.tokenizer")
        reqs = [generate_request(f"doomed {i}", 1500) for i in range(4)]
        results, threads = start_streams(stub, reqs)
        for r in results:
            assert r.first_token.wait(60)
        seen: list[int] = []
        watcher = threading.Thread(target=watch_health, args=(stack.tokenizer, seen), daemon=True)
        watcher.start()
        killed_at = time.monotonic()
        os.kill(stack.service_pid("services.scheduler"), signal.SIGKILL)
        for r in results:
            assert r.done.wait(10)
        assert time.monotonic() - killed_at < 5 + 1
        for r in results:
            assert r.error == grpc.StatusCode.UNAVAILABLE, (r.error, r.error_message)
            assert "scheduler" in r.error_message
        watcher.join(30)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
        # Back after the launcher's restart; the tokenizer was never restarted.
        stack.launcher.wait_output("scheduler back", timeout=120)
        wait_grpc_serving(stack.tokenizer, timeout=60)
        out, _ = start_streams(stub, [generate_request("after", 8)])
        assert out[0].done.wait(60) and out[0].error is None and len(out[0].output_ids) == 8
        assert stack.service_pid("services.tokenizer") == tokenizer_pid
