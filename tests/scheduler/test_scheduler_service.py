"""The real scheduler process (`python -m services.scheduler`) between a fake tokenizer and a fake detokenizer."""

from __future__ import annotations

import queue
import signal
import threading
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.process import ServiceProcess, free_port, python_cmd, wait_grpc_serving
from ringserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.model_executor.sampling import SamplingParams
from tests.scheduler.fake_detokenizer import FakeDetokenizer

pytestmark = pytest.mark.e2e
PROMPTS = [[11, 22, 33, 44, 55], list(range(100, 140)), [7] * 3 + list(range(300, 320))]


class FakeTokenizer:
    """One Connect stream: send requests/aborts; collect LoadReports and Rejections."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, owner: str) -> None:
        self.owner = owner
        self._out: queue.Queue = queue.Queue()
        self._out.put(scheduler_pb2.ConnectRequest(hello=scheduler_pb2.Hello(owner=owner)))
        self.call = stub.Connect(iter(self._out.get, None))
        self.responses: list[scheduler_pb2.ConnectResponse] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for resp in self.call:
                with self.cond:
                    self.responses.append(resp)
                    self.cond.notify_all()
        except grpc.RpcError:
            pass

    def send(self, requests=(), abort_rids=()) -> None:
        self._out.put(scheduler_pb2.ConnectRequest(requests=list(requests), abort_rids=list(abort_rids)))

    def wait_load(self, pred, timeout: float = 30.0) -> scheduler_pb2.LoadReport:
        """Block until a LoadReport after now satisfies pred (reports come every interval)."""
        with self.cond:
            start = len(self.responses)
            ok = self.cond.wait_for(lambda: any(r.HasField("load") and pred(r.load) for r in self.responses[start:]),
                                    timeout)
            assert ok, "no matching LoadReport"
            return [r.load for r in self.responses[start:] if r.HasField("load") and pred(r.load)][0]

    def close(self) -> None:
        self._out.put(None)


def request(rid: str, ids: list[int], owner: str, max_new: int = 8, stream: bool = True):
    return scheduler_pb2.TokenizedRequest(
        rid=rid, owner=owner, input_ids=ids, stream=stream,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))


@pytest.fixture(scope="module")
def expected(model_dir: str) -> list[list[int]]:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=2000))
    return [r.output_ids for r in engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                          ignore_eos=True))]


@pytest.fixture(scope="module")
def stack(model_dir: str):
    detok_port, port, sglang_port = free_port(), free_port(), free_port()
    detok = FakeDetokenizer(detok_port)
    proc = ServiceProcess("scheduler", python_cmd(
        "services.scheduler", "--port", str(port), "--metrics-port", "-1", "--model", model_dir,
        "--detokenizer", f"127.0.0.1:{detok_port}", "--scheduler-id", "sched-test", "--max-total-tokens", "4000",
        "--max-queued-requests", "4", "--load-report-interval-s", "0.1", "--grace-period-s", "5",
        "--sglang-grpc-port", str(sglang_port))).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    box: dict[str, Any] = {"detok": detok, "sglang": f"127.0.0.1:{sglang_port}"}
    try:
        proc.wait_serving(f"127.0.0.1:{port}", timeout=120)
        yield proc, channel, box, port
    finally:
        channel.close()
        code = proc.stop(timeout=20)
        box["detok"].stop()
        assert code == 0, proc.output()


def test_step_batches_carry_greedy_tokens(stack, expected) -> None:
    proc, channel, box, _ = stack
    detok: FakeDetokenizer = box["detok"]
    assert detok.scheduler_ids == ["sched-test"]
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    info = stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
    assert info.max_total_num_tokens == 4000 and info.page_size == 1 and info.device == "cpu"
    assert info.architecture == "LlamaForCausalLM" and "Qwen3MoeForCausalLM" in info.supported_architectures
    tok = FakeTokenizer(stub, "tok-1")
    tok.send([request(f"g{i}", p, "tok-1") for i, p in enumerate(PROMPTS[:2])])
    tok.send([request("g2", PROMPTS[2], "tok-1", stream=False)])
    detok.wait_for(lambda bs: sum(1 for b in bs for d in b.deltas if d.HasField("finish")) >= 3)
    for i in range(3):
        ds = detok.deltas(f"g{i}")
        ids = [t for d in ds for t in d.ids]
        assert ids == expected[i], f"g{i}"
        assert ds[0].HasField("params") and ds[0].params.owner == "tok-1"
        assert [d.offset for d in ds] == ([0] if i == 2 else list(range(8)))  # one delta per step
        assert ds[-1].finish.type == "length"
    for b in detok.batches:  # one StepBatch per step: a request appears at most once in it
        rids = [d.rid for d in b.deltas]
        assert len(rids) == len(set(rids))
    tok.close()


def test_abort_and_stream_close_free_kv(stack) -> None:
    _, channel, box, _ = stack
    detok: FakeDetokenizer = box["detok"]
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    tok = FakeTokenizer(stub, "tok-a")
    tok.send([request("long-a", list(range(500, 560)), "tok-a", max_new=3000)])
    detok.wait_for(lambda bs: len([d for b in bs for d in b.deltas if d.rid == "long-a"]) >= 3)
    assert stub.GetLoad(scheduler_pb2.GetLoadRequest()).load.num_used_tokens > 0
    tok.send(abort_rids=["long-a"])
    tok.wait_load(lambda ld: ld.num_running_reqs == 0 and ld.num_used_tokens == 0)
    # A second replica goes away mid-request: its requests are aborted, KV freed.
    other = FakeTokenizer(stub, "tok-b")
    other.send([request("long-b", list(range(600, 650)), "tok-b", max_new=3000)])
    detok.wait_for(lambda bs: len([d for b in bs for d in b.deltas if d.rid == "long-b"]) >= 3)
    other.close()
    ld = tok.wait_load(lambda ld: ld.num_running_reqs == 0 and ld.num_used_tokens == 0)
    assert ld.max_total_num_tokens == 4000
    tok.close()


def test_queue_limit_rejects_with_resource_exhausted(stack) -> None:
    _, channel, box, _ = stack
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    tok = FakeTokenizer(stub, "tok-q")
    tok.send([request(f"q{i}", [5, 6, 7], "tok-q", max_new=2) for i in range(12)])
    with tok.cond:
        assert tok.cond.wait_for(lambda: any(r.rejections for r in tok.responses), 30)
        rej = [j for r in tok.responses for j in r.rejections]
    assert rej and all(j.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for j in rej)
    assert 0 < len(rej) < 12
    tok.wait_load(lambda ld: ld.num_queue_reqs == 0 and ld.num_running_reqs == 0)  # the accepted ones ran
    tok.close()


def test_detokenizer_restart_triggers_resync(stack) -> None:
    proc, channel, box, port = stack
    detok: FakeDetokenizer = box["detok"]
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    tok = FakeTokenizer(stub, "tok-r")
    tok.send([request("live", list(range(700, 730)), "tok-r", max_new=3000)])
    detok.wait_for(lambda bs: len([d for b in bs for d in b.deltas if d.rid == "live"]) >= 2)
    detok.stop()
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    for resp in watch:  # NOT_SERVING while the push stream is down
        if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
    watch.cancel()
    box["detok"] = detok = FakeDetokenizer(detok.port)
    first = detok.wait_for(lambda bs: bs[0] if bs else None)
    assert first.resync
    (d,) = [d for d in first.deltas if d.rid == "live"]
    assert d.offset == 0 and len(d.ids) >= 2 and d.HasField("params") and d.params.owner == "tok-r"
    proc.wait_serving(f"127.0.0.1:{port}", timeout=30)
    # A tokenizer (re)subscribing makes the detokenizer ask for one owner's state.
    n = len(detok.batches)
    detok.request_resync("tok-r")
    again = detok.wait_for(lambda bs: next((b for b in bs[n:] if b.resync), None))
    (d2,) = [d for d in again.deltas if d.rid == "live"]
    assert d2.offset == 0 and len(d2.ids) >= len(d.ids)
    tok.close()  # closing the stream aborts "live"
    tok2 = FakeTokenizer(stub, "tok-r2")
    tok2.wait_load(lambda ld: ld.num_running_reqs == 0)
    tok2.close()


def test_sglang_port_serves_while_the_detokenizer_is_down(stack, expected) -> None:
    """Outputs of SGLang-protocol requests go back on their own call: that port stays SERVING and
    answers while the push stream is down, and none of its requests reaches the detokenizer."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc

    proc, channel, box, port = stack
    box["detok"].stop()
    health = health_pb2_grpc.HealthStub(channel)
    for resp in health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30):
        if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
    wait_grpc_serving(box["sglang"], 10, service="sglang.grpc.scheduler.SglangScheduler")
    with grpc.insecure_channel(box["sglang"]) as ch:
        stub = sg_grpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(sg.HealthCheckRequest(), timeout=10).healthy
        req = sg.GenerateRequest(request_id="direct", tokenized=sg.TokenizedInput(input_ids=PROMPTS[0]),
                                 sampling_params=sg.SamplingParams(temperature=0, top_p=1, top_k=-1, n=1,
                                                                   max_new_tokens=8, ignore_eos=True))
        (done,) = [m.complete for m in stub.Generate(req, timeout=30)]
    assert done.finish_reason == "length" and list(done.output_ids) == expected[0]
    box["detok"] = detok = FakeDetokenizer(box["detok"].port)
    first = detok.wait_for(lambda bs: bs[0] if bs else None)
    assert first.resync and not any("direct" in d.rid for b in detok.batches for d in b.deltas)
    proc.wait_serving(f"127.0.0.1:{port}", timeout=30)


def test_sigterm_drains_and_exits_zero(stack) -> None:
    proc, channel, box, _ = stack
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    tok = FakeTokenizer(stub, "tok-d")
    tok.send([request("drain", [1, 2, 3, 4], "tok-d", max_new=20)])
    detok: FakeDetokenizer = box["detok"]
    detok.wait_for(lambda bs: any(d.rid == "drain" for b in bs for d in b.deltas))
    proc.signal(signal.SIGTERM)
    detok.wait_for(lambda bs: any(d.rid == "drain" and d.HasField("finish") for b in bs for d in b.deltas), timeout=10)
    assert proc.proc.wait(30) == 0
    tok.close()
