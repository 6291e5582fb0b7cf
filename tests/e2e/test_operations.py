"""Operations through the real processes, over HTTP as an RL trainer drives them: abort all (the
logic of SGLang's abort_timeout_kit AbortAllMixin), pause in each mode and continue with requests
in flight, weights from disk while 16 streams run, and a profile trace."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from ringserve.v1 import api_pb2, api_pb2_grpc
from tests.e2e.reference import PROMPTS, greedy_body, greedy_reference
from tests.e2e.stack import Stack, running_stack, sse_events

pytestmark = pytest.mark.e2e

WAIT_S = 120.0


@pytest.fixture(scope="module")
def stack(model_dir: str):
    # SGLang's abort-all test runs with --max-running-requests 8: some requests are still queued.
    with running_stack(model_dir, "--scheduler-args", "--max-running-requests 8") as s:
        yield s


@dataclass
class Stream:
    """One SSE /generate call, read in a thread: its last event, or the error that ended it."""

    body: dict
    last: dict = field(default_factory=dict)
    events: int = 0
    error: str = ""
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def output_ids(self) -> list[int]:
        return self.last.get("output_ids", [])

    @property
    def meta(self) -> dict:
        return self.last.get("meta_info", {})


def _read(url: str, s: Stream) -> None:
    try:
        with httpx.stream("POST", f"{url}/generate", json={**s.body, "stream": True}, timeout=WAIT_S) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.read().decode()}"
                return
            for ev in sse_events(r):
                if isinstance(ev, dict):
                    if "error" in ev:
                        s.error = json.dumps(ev["error"])
                        continue
                    s.last, s.events = ev, s.events + 1
                    s.started.set()
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.started.set()
        s.done.set()


def start_streams(stack: Stack, bodies: list[dict]) -> list[Stream]:
    streams = [Stream(b) for b in bodies]
    for s in streams:
        threading.Thread(target=_read, args=(stack.gateway_url, s), daemon=True).start()
    return streams


def wait_all(streams: list[Stream], what: str = "done") -> None:
    deadline = time.monotonic() + WAIT_S
    for s in streams:
        assert getattr(s, what).wait(max(0.0, deadline - time.monotonic())), f"a stream hung ({what})"


def load(stack: Stack) -> list[dict]:
    return httpx.get(f"{stack.gateway_url}/get_load", timeout=10).json()


def until_load(stack: Stack, **want: int) -> None:
    """Until the first scheduler's load has these values (load reports come every 0.5 s)."""
    deadline = time.monotonic() + 10
    while {k: load(stack)[0][k] for k in want} != want:
        assert time.monotonic() < deadline, (want, load(stack))
        time.sleep(0.05)  # polling the server's state, not waiting for readiness


def long_body(n: int = 1500) -> dict:
    return {"text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}


def test_abort_all_as_sglangs_kit(stack: Stack) -> None:
    """32 decodes (8 running, the rest queued), then abort_all: every one ends with finish_reason
    abort and the server stays up. SGLang's kit sleeps 2 s first; this waits for the decodes."""
    url = stack.gateway_url

    def run_decode() -> dict:
        return httpx.post(f"{url}/generate", json=long_body(), timeout=60).json()

    with cf.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run_decode) for _ in range(32)]
        deadline = time.monotonic() + WAIT_S
        while not (load(stack)[0]["num_reqs"] >= 32 and load(stack)[0]["num_tokens"] > 100):
            assert time.monotonic() < deadline
            time.sleep(0.05)  # polling the server's progress, not waiting for readiness
        r = httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=10)
        r.raise_for_status()
        assert r.json()["num_aborted"] == 32
        for f in cf.as_completed(futures, timeout=WAIT_S):
            assert f.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert stack.launcher.proc is not None and stack.launcher.proc.poll() is None
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    until_load(stack, num_reqs=0)


def test_abort_all_over_grpc(stack: Stack) -> None:
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)
        streams = start_streams(stack, [long_body() for _ in range(3)])
        wait_all(streams, "started")
        resp = stub.Abort(api_pb2.AbortRequest(abort_all=True), timeout=10)
        assert resp.found and resp.num_aborted == 3
        wait_all(streams)
        assert [s.meta["finish_reason"]["type"] for s in streams] == ["abort"] * 3
        assert len(stub.GetLoad(api_pb2.InferenceServiceGetLoadRequest(), timeout=10).loads) == 1


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_and_continue_with_requests_in_flight(stack: Stack, model_dir: str, mode: str) -> None:
    url = stack.gateway_url
    n = 200  # long enough to be mid-decode at the pause
    reference = greedy_reference(model_dir, PROMPTS, n)
    prompts = list(PROMPTS[:4])
    streams = start_streams(stack, [greedy_body(p, n) for p in prompts])
    wait_all(streams, "started")
    r = httpx.post(f"{url}/pause_generation", json={"mode": mode}, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    k = r.json()["num_requests"]  # aborted, retracted or held
    assert k >= 1
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "paused", "mode": mode}
    late = start_streams(stack, [greedy_body(PROMPTS[5], n)])  # accepted while paused: it queues
    if mode == "abort":
        wait_all(streams)
        assert all(s.meta["finish_reason"]["type"] == "abort" for s in streams)
        until_load(stack, num_reqs=1, num_waiting_reqs=1)
    elif mode == "retract":  # all back in the queue
        until_load(stack, num_reqs=k + 1, num_waiting_reqs=k + 1)
    else:  # still in the running batch
        until_load(stack, num_reqs=k + 1, num_waiting_reqs=1)
    assert not any(s.done.is_set() for s in late + ([] if mode == "abort" else streams))
    r = httpx.post(f"{url}/continue_generation", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_all(streams + late)
    assert not any(s.error for s in streams + late)
    if mode != "abort":
        for p, s in zip(prompts, streams):
            assert s.output_ids == reference[p], (mode, p)
            assert s.meta["finish_reason"]["type"] == "length"
    assert late[0].output_ids == reference[PROMPTS[5]]


def test_update_weights_while_16_streams_run(stack: Stack, model_dir: str, model_dir_v2: str,
                                              tmp_path: Path) -> None:
    url = stack.gateway_url
    n = 48
    prompts = list(PROMPTS[:8])
    old = greedy_reference(model_dir, PROMPTS, n)
    new = greedy_reference(model_dir_v2, PROMPTS, n)
    assert all(old[p] != new[p] for p in prompts)

    # A checkpoint of another shape is refused, naming the tensor; the old weights stay.
    from safetensors.numpy import load_file, save_file
    bad = tmp_path / "bad"
    import shutil
    shutil.copytree(model_dir_v2, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"][:-1].copy()
    save_file(w, str(bad / "model.safetensors"))
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60)
    assert r.status_code == 400 and "model.norm.weight" in r.json()["message"]
    assert stack.generate(greedy_body(prompts[0], n))["output_ids"] == old[prompts[0]]

    streams = start_streams(stack, [greedy_body(prompts[i % 8], n) for i in range(16)])
    wait_all(streams[:8], "started")
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": model_dir_v2, "weight_version": "v2"},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["success"] and r.json()["weight_version"] == "v2"
    wait_all(streams)
    for s in streams:  # each complete on one set of weights, and says which
        assert not s.error, s.error
        assert s.meta["finish_reason"]["type"] == "length"
        version = s.meta["weight_version"]
        assert s.output_ids == (old if version == "default" else new)[s.body["text"]], version
    assert any(s.meta["weight_version"] == "default" for s in streams)  # those running finished on v1
    assert httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"] == "v2"
    bodies = [greedy_body(p, n) for p in prompts]
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(stack.generate, bodies))
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == new[p], p  # transformers on the new weights
        assert out["meta_info"]["weight_version"] == "v2"

    # Back to the first weights, aborting what runs: every stream ends, with an explicit reason.
    streams = start_streams(stack, [long_body(800) for _ in range(16)])
    wait_all(streams[:8], "started")
    r = httpx.post(f"{url}/update_weights_from_disk",
                   json={"model_path": model_dir, "abort_all_requests": True, "weight_version": "v1"}, timeout=300)
    assert r.status_code == 200 and r.json()["success"], r.text
    wait_all(streams)
    for s in streams:
        assert not s.error, s.error
        reason = s.meta["finish_reason"]
        assert reason["type"] in ("abort", "length")
        if reason["type"] == "abort":
            assert "weight update" in reason["message"]
    assert stack.generate(greedy_body(prompts[1], n))["output_ids"] == old[prompts[1]]


def test_profile_over_http_writes_a_torch_trace(stack: Stack, tmp_path: Path) -> None:
    url = stack.gateway_url
    r = httpx.post(f"{url}/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"],
                                                 "record_shapes": True}, timeout=60)
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    again = httpx.post(f"{url}/start_profile", json={"output_dir": str(tmp_path)}, timeout=60)
    assert again.status_code == 400 and "already profiling" in again.json()["error"]["message"]
    stack.generate(greedy_body("Once upon a time", 8))
    r = httpx.post(f"{url}/stop_profile", timeout=120)
    assert r.status_code == 200
    files = list(tmp_path.glob("*.pt.trace.json"))
    assert len(files) == 1 and str(files[0]) in r.text
    trace = json.loads(files[0].read_text())
    names = {ev.get("name", "") for ev in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)
    assert httpx.post(f"{url}/stop_profile", timeout=60).status_code == 400  # not profiling
