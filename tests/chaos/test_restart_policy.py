"""Six detokenizer kills 20 s apart under streaming load (`make chaos`): no stream fails.

A stream counts once the tokenizer admitted it: while no detokenizer is up the tokenizer refuses new
requests at once with UNAVAILABLE "detokenizer unavailable" (by design; the client retries them),
and what must not happen is an admitted stream failing.

Through the launcher with its default restart policy and the tokenizer's default grace. Before
issue #31 the backoff kept doubling across these kills (1, 2, 4, 8, 16, 30 s: the crashed process
never ran the minute that reset it), and the sixth outage lasted the tokenizer's 30 s grace, so every
in-flight stream failed with "detokenizer unavailable" although the detokenizer came back.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import pytest

from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2_grpc
from tests.e2e.grpc_client import StreamResult, generate_request, stream_generate
from tests.e2e.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]

KILLS = 6
APART_S = 20.0
CLIENTS = 4
REFUSED = "detokenizer unavailable"  # the admission refusal, not the grace's "... for more than Ns"


def test_six_detokenizer_kills_20s_apart_fail_no_stream(real_model_dir: str) -> None:
    tok = TextTokenizer.from_model(real_model_dir)
    results: list[StreamResult] = []
    refused: list[StreamResult] = []
    stop = threading.Event()
    with running_stack(real_model_dir) as stack, grpc.insecure_channel(stack.tokenizer) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)

        def client(i: int) -> None:  # back-to-back streams, so some are always in flight
            while not stop.is_set():
                r = StreamResult()
                stream_generate(stub, generate_request(f"client {i}: 你好 😀 写一首诗", 48), r, timeout=300)
                if r.error is not None and r.error_message == REFUSED and not r.output_ids:
                    refused.append(r)
                    stop.wait(0.5)  # a client's retry backoff
                    continue
                results.append(r)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        waits = []
        for _ in range(KILLS):
            time.sleep(APART_S)  # the schedule: a kill every 20 s
            mark = stack.launcher.lines_seen
            os.kill(stack.service_pid("services.detokenizer"), signal.SIGKILL)
            line = stack.launcher.wait_output("detokenizer exited", timeout=30, after=mark)
            waits.append(float(re.search(r"restarting in ([0-9.]+)s", line).group(1)))  # type: ignore[union-attr]
            stack.launcher.wait_output("detokenizer back", timeout=120, after=mark)
        stop.set()
        for t in threads:
            t.join(330)
    print(f"\n{KILLS} detokenizer kills {APART_S:.0f}s apart: restart waits {waits}; {len(results)} "
          f"streams, {len(refused)} refused at admission during outages")
    assert max(waits) <= 2.0, waits  # healthy between kills: the backoff starts over each time
    failed = [(r.error, r.error_message) for r in results if r.error is not None]
    assert not failed, failed
    for r in results:
        assert r.text == tok.decode(r.output_ids) and len(r.output_ids) == 48
    assert len(results) > CLIENTS  # streams ran across the kills
