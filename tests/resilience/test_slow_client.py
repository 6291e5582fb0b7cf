"""A client that stops reading its stream stalls nobody else and grows no memory without bound.

The stalled client's SSE bytes fill its TCP socket; uvicorn's send then waits, so the gateway stops
reading that gRPC stream; HTTP/2 flow control makes the tokenizer's writes for it wait too. What
piles up is that one request's output in the tokenizer's ReqState (bounded by max_new_tokens) and
the scheduler keeps decoding it to the end (bounded). Where the bytes wait (socket buffers, the
gateway's gRPC receive window, which BDP probing grows to megabytes, or the tokenizer's ReqState)
varies; what must hold is that the wait is bounded and every other request is unaffected.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.resilience.cluster import Svc, cluster, eventually, rid_to_state_size, rss_kib, scheduler_load

pytestmark = pytest.mark.e2e

OTHERS = 8
OTHER_TOKENS = 64


def _stalled_stream(gw: Svc) -> socket.socket:
    """Open a streaming /generate with big chunks (top-20 logprobs per token) and never read it."""
    body = json.dumps({"text": "slow reader", "stream": True, "return_logprob": True, "top_logprobs_num": 20,
                       "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}})
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.sendall((f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    return sock


def _others(gw: Svc) -> float:
    """Run OTHERS streaming requests at once; return the slowest one's latency."""
    latencies: list[float] = []
    errors: list[str] = []

    def one(i: int) -> None:
        t0 = time.monotonic()
        body = {"text": f"neighbour {i}", "stream": True,
                "sampling_params": {"max_new_tokens": OTHER_TOKENS, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", f"{gw.url}/generate", json=body, timeout=120) as r:
            last = [line for line in r.iter_lines() if line.startswith("data:")][-1]
        if last != "data: [DONE]" or r.status_code != 200:
            errors.append(f"{r.status_code} {last}")
        latencies.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(OTHERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(latencies) == OTHERS, errors
    return max(latencies)


def test_stalled_reader_does_not_stall_others(model_dir: str) -> None:
    with cluster(model_dir) as c:
        detok, sched, tok = c.ring()
        gw = c.gateway(tok)
        baseline = _others(gw)
        rss_before = {s.proc.name: rss_kib(s.proc.pid) for s in (tok, gw)}  # type: ignore[arg-type]

        mark = sched.proc.lines_seen
        stalled = _stalled_stream(gw)
        try:
            # The scheduler decodes the stalled request to the end; nothing waits on the reader.
            sched.proc.wait_output("finished length output_tokens=1500", timeout=120, after=mark)
            during = _others(gw)
            rss_during = {s.proc.name: rss_kib(s.proc.pid) for s in (tok, gw)}  # type: ignore[arg-type]
        finally:
            stalled.close()
        print(f"slow client: others' slowest latency {baseline:.2f}s idle, {during:.2f}s beside a stalled "
              f"reader; RSS KiB before {rss_before} during {rss_during}")
        assert during < 3 * baseline + 10
        for name, before in rss_before.items():
            assert rss_during[name] - before < 64 * 1024, (name, before, rss_during[name])
        # Closing the stalled socket releases everything.
        eventually(lambda: rid_to_state_size(tok.target) == 0, timeout=60, what="rid_to_state empty")
        eventually(lambda: scheduler_load(sched.target).num_running_reqs == 0, timeout=30, what="idle")
