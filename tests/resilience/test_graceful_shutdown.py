"""SIGTERM on each service: intake stops, in-flight work finishes (within the grace), exit 0.

And the launcher (`make run`): SIGTERM or SIGINT stops every service it started; no process is left.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import grpc
import httpx
import pytest

from ringserve.v1 import api_pb2_grpc
from tests.e2e.grpc_client import StreamResult, generate_request, start_streams
from tests.e2e.stack import running_stack
from tests.resilience.cluster import Svc, cluster

pytestmark = pytest.mark.e2e

TOKENS = 600  # a few seconds of decoding on a loaded CPU: long enough to be in flight at SIGTERM


def _in_flight(tok: Svc) -> tuple[list[StreamResult], list[threading.Thread], grpc.Channel]:
    ch = grpc.insecure_channel(tok.target)
    results, threads = start_streams(api_pb2_grpc.InferenceServiceStub(ch),
                                     [generate_request(f"in flight {i}", TOKENS) for i in range(2)])
    for r in results:
        assert r.first_token.wait(60) and r.error is None, (r.error, r.error_message)
    return results, threads, ch


def _completed(results: list[StreamResult], threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(90)
    for r in results:
        assert r.error is None, (r.error, r.error_message)
        assert len(r.output_ids) == TOKENS and r.finish_type == "length"


def _exit_code(svc: Svc, timeout: float = 60) -> int:
    assert svc.proc.proc is not None
    return svc.proc.proc.wait(timeout)


def test_sigterm_drains_every_service(model_dir: str) -> None:
    with cluster(model_dir) as c:
        detok, sched, tok = c.ring()
        gw = c.gateway(tok)

        # Gateway: a stream in flight at SIGTERM completes; then the process exits 0.
        lines: list[str] = []
        got_first = threading.Event()

        def stream() -> None:
            body = {"text": "gateway drain", "stream": True,
                    "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}
            with httpx.stream("POST", f"{gw.url}/generate", json=body, timeout=90) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        got_first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert got_first.wait(60)
        gw.proc.signal(signal.SIGTERM)
        t.join(90)
        assert lines[-1] == "data: [DONE]"
        assert _exit_code(gw) == 0

        # Tokenizer: in-flight calls finish, new calls are refused, exit 0.
        results, threads, ch = _in_flight(tok)
        mark = tok.proc.lines_seen
        tok.proc.signal(signal.SIGTERM)
        tok.proc.wait_output("draining", timeout=30, after=mark)
        with pytest.raises(grpc.RpcError) as refused:
            api_pb2_grpc.InferenceServiceStub(ch).Generate(generate_request("late", 4), timeout=30).next()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        _completed(results, threads)
        ch.close()
        assert _exit_code(tok) == 0

        # Scheduler (behind a fresh tokenizer): running requests finish, new ones are refused, exit 0.
        tok2 = c.tokenizer(sched, detok, name="tokenizer-2")
        results, threads, ch = _in_flight(tok2)
        mark = sched.proc.lines_seen
        sched.proc.signal(signal.SIGTERM)
        sched.proc.wait_output("SIGTERM: draining", timeout=30, after=mark)
        late: list[StreamResult] = start_streams(api_pb2_grpc.InferenceServiceStub(ch),
                                                 [generate_request("late", 4)])[0]
        assert late[0].done.wait(60)
        assert late[0].error == grpc.StatusCode.UNAVAILABLE, (late[0].error, late[0].error_message)
        _completed(results, threads)
        ch.close()
        assert _exit_code(sched) == 0

        # Detokenizer: nothing left in flight; drains and exits 0.
        detok.proc.signal(signal.SIGTERM)
        assert _exit_code(detok) == 0
        tok2.proc.signal(signal.SIGTERM)
        assert _exit_code(tok2) == 0


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_signal_leaves_no_process_behind(model_dir: str, sig: int) -> None:
    with running_stack(model_dir) as stack:
        launcher_pid = stack.launcher.pid
        assert launcher_pid is not None
        pids = _descendants(launcher_pid)
        services = {stack.service_pid(m) for m in ("services.detokenizer", "services.scheduler",
                                                  "services.tokenizer", "gateway")}
        assert services <= pids
        os.kill(launcher_pid, sig)
        assert stack.launcher.proc is not None
        assert stack.launcher.proc.wait(90) == 0
        left = [p for p in pids if _alive(p)]
        assert not left, f"left behind: {left}"
