"""A tokenizer replica or a gateway dies (SIGKILL): the rest of the ring cleans up and keeps serving.

DESIGN.md: "A tokenizer replica dies: the scheduler aborts its requests; no orphaned KV." A gateway
is stateless: killing one of two must not disturb the other nor leave state in the tokenizer.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from ringserve.v1 import api_pb2_grpc
from tests.e2e.grpc_client import generate_request, start_streams
from tests.resilience.cluster import cluster, eventually, rid_to_state_size, scheduler_load

pytestmark = pytest.mark.e2e


def test_killed_tokenizer_replica_frees_its_kv(model_dir: str) -> None:
    with cluster(model_dir) as c:
        detok = c.detokenizer()
        sched = c.scheduler(detok)
        doomed = c.tokenizer(sched, detok, name="tokenizer-a")
        survivor = c.tokenizer(sched, detok, name="tokenizer-b")
        idle = scheduler_load(sched.target)
        assert idle.num_running_reqs == 0
        with grpc.insecure_channel(doomed.target) as ch_a, grpc.insecure_channel(survivor.target) as ch_b:
            lost, _ = start_streams(api_pb2_grpc.InferenceServiceStub(ch_a),
                                    [generate_request(f"orphan {i} " * 20, 1500) for i in range(4)])
            kept, threads = start_streams(api_pb2_grpc.InferenceServiceStub(ch_b),
                                          [generate_request("survivor", 300)])
            for r in lost + kept:
                assert r.first_token.wait(60)
                assert r.error is None, (r.error, r.error_message)
            # GetLoad is the last step's snapshot: it catches up within a step or two.
            eventually(lambda: (ld := scheduler_load(sched.target)).num_running_reqs == 5
                       and ld.num_used_tokens > idle.num_used_tokens, timeout=30, what="5 requests running")
            mark = sched.proc.lines_seen
            doomed.proc.signal(signal.SIGKILL)
            # Keepalive/HTTP2 notices the dead peer; the scheduler aborts the owner's requests.
            sched.proc.wait_output("its requests are aborted", timeout=30, after=mark)
            threads[0].join(120)
            assert kept[0].error is None and len(kept[0].output_ids) == 300
            eventually(lambda: (ld := scheduler_load(sched.target)).num_running_reqs == 0
                       and ld.num_queue_reqs == 0 and ld.num_used_tokens == idle.num_used_tokens,
                       timeout=30, what="scheduler idle with its KV freed")
            assert rid_to_state_size(survivor.target) == 0
            # The scheduler still serves the surviving replica.
            again, t2 = start_streams(api_pb2_grpc.InferenceServiceStub(ch_b), [generate_request("after", 8)])
            t2[0].join(60)
            assert again[0].error is None and len(again[0].output_ids) == 8
        for svc in (detok, sched, survivor):
            assert not svc.errors(), svc.errors()


def test_killed_gateway_leaves_the_other_serving(model_dir: str) -> None:
    with cluster(model_dir) as c:
        detok, sched, tok = c.ring()
        gw_a = c.gateway(tok, name="gateway-a")
        gw_b = c.gateway(tok, name="gateway-b")
        body = {"text": "two gateways", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
        started = threading.Event()
        outcome: list[BaseException | None] = []

        def stream_through_a() -> None:
            try:
                with httpx.stream("POST", f"{gw_a.url}/generate", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
                outcome.append(None)
            except httpx.HTTPError as e:  # the gateway died under us: expected
                outcome.append(e)
            finally:
                started.set()

        t = threading.Thread(target=stream_through_a, daemon=True)
        t.start()
        assert started.wait(60)
        gw_a.proc.signal(signal.SIGKILL)
        t.join(30)
        assert outcome and outcome[0] is not None  # the stream through the dead gateway broke
        # The tokenizer saw the cancel (the HTTP/2 stream died with the gateway) and cleaned up.
        eventually(lambda: rid_to_state_size(tok.target) == 0, timeout=30, what="rid_to_state empty")
        eventually(lambda: scheduler_load(sched.target).num_running_reqs == 0, timeout=30,
                   what="scheduler idle")
        for i in range(3):
            r = httpx.post(f"{gw_b.url}/generate", timeout=60,
                           json={"text": f"still here {i}", "sampling_params": {"max_new_tokens": 8}})
            assert r.status_code == 200, r.text
        assert httpx.get(f"{gw_b.url}/health", timeout=10).status_code == 200
        for svc in (detok, sched, tok, gw_b):
            assert not svc.errors(), svc.errors()


def test_killed_tokenizer_under_the_gateway_ends_streams_then_recovers(model_dir: str) -> None:
    """The gateway's GenerateStream breaks: every request on it ends with an error event, new ones get
    503 at once, and the gateway serves again when a tokenizer is back on the same address."""
    with cluster(model_dir) as c:
        detok, sched, tok = c.ring()
        gw = c.gateway(tok)
        body = {"text": "tokenizer goes away", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
        started = threading.Barrier(5)
        events: list[list[str]] = [[] for _ in range(4)]

        def stream(i: int) -> None:
            with httpx.stream("POST", f"{gw.url}/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])
                        if len(events[i]) == 1:
                            started.wait(30)

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(60)
        tok.proc.signal(signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a stream hung after its tokenizer died"
        assert time.monotonic() - t0 < 20
        for ev in events:  # each ended with an error event, then [DONE]
            assert ev[-1] == "[DONE]" and "error" in json.loads(ev[-2]), ev[-3:]
        r = httpx.post(f"{gw.url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
                       timeout=10)
        assert r.status_code == 503 and r.headers.get("retry-after")
        eventually(lambda: scheduler_load(sched.target).num_running_reqs == 0, timeout=30, what="scheduler idle")
        c.tokenizer(sched, detok, port=tok.port)  # back on the same address
        eventually(lambda: httpx.get(f"{gw.url}/health", timeout=10).status_code == 200, timeout=30,
                   what="gateway healthy again")
        r = httpx.post(f"{gw.url}/generate", json={"text": "back", "sampling_params": {"max_new_tokens": 8}},
                       timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, r.text
        for svc in (detok, sched, gw):
            assert not [e for e in svc.errors() if "tokenizer" not in e], svc.errors()
