"""`make run` end to end: four real processes, started in order, restarted when killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from ringserve.process import wait_grpc_serving
from ringserve.text_tokenizer import TextTokenizer
from tests.e2e.stack import Stack, running_stack, sse_events

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(model_dir: str):
    with running_stack(model_dir) as s:
        yield s


def test_services_start_in_order_each_gated_on_the_previous(stack: Stack) -> None:
    log = stack.launcher.output()
    order = [log.index(f"launcher: {name} ready in") for name in ("detokenizer", "scheduler", "tokenizer", "gateway")]
    assert order == sorted(order)
    # Each service is started only after the previous one reported ready.
    for prev, nxt in [("detokenizer", "scheduler"), ("scheduler", "tokenizer"), ("tokenizer", "gateway")]:
        assert log.index(f"launcher: {prev} ready in") < log.index(f"launcher: starting {nxt}:")


def test_curl_example_answers(stack: Stack) -> None:
    out = stack.generate({"text": "你好", "sampling_params": {"max_new_tokens": 8}})
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) > 0
    assert isinstance(out["text"], str)


def test_greedy_stream_through_the_gateway_equals_transformers(stack: Stack, model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = TextTokenizer.from_model(model_dir)
    prompt = "The quick brown fox 你好 🦊"
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "min_new_tokens": 24}}
    with httpx.stream("POST", f"{stack.gateway_url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert isinstance(last, dict)
    ids = last["output_ids"]
    # Streamed text is exactly the decode of the output ids.
    assert last["text"] == tok.decode(ids)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    input_ids = torch.tensor([tok.encode(prompt)])
    ref = model.generate(input_ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ids == ref[0, input_ids.shape[1]:].tolist()


def test_killed_service_is_restarted(stack: Stack) -> None:
    old = stack.service_pid("services.detokenizer")
    mark = stack.launcher.lines_seen
    os.kill(old, signal.SIGKILL)
    # The launcher notices, restarts it after its backoff and waits for SERVING itself.
    stack.launcher.wait_output("detokenizer back", timeout=60, after=mark)
    wait_grpc_serving(stack.detokenizer, timeout=60)
    new = stack.service_pid("services.detokenizer")
    assert new != old
    wait_grpc_serving(stack.tokenizer, timeout=60)
    out = stack.generate({"text": "again", "sampling_params": {"max_new_tokens": 4}})
    assert len(out["output_ids"]) == 4 or out["meta_info"]["finish_reason"]["type"] == "stop"


def test_io_services_pinned_apart_from_the_forward_on_a_cpu_machine(stack: Stack, model_dir: str) -> None:
    import psutil

    from ringserve import cpu_layout
    from ringserve.model_source import parameter_count

    assert stack.launcher.proc is not None
    params = parameter_count(Path(model_dir))
    assert params is not None and params < cpu_layout.LARGE_MODEL_PARAMS  # the tiny model: pinned on 2+ cores
    layout = cpu_layout.plan(-1, cpu_layout.scheduler_on_cpu(""), model_params=params)
    everywhere = sorted(os.sched_getaffinity(0))
    seen = {}
    for p in psutil.Process(stack.launcher.proc.pid).children(recursive=True):
        args = p.cmdline()
        module = args[args.index("-m") + 1] if "-m" in args else ""
        if module in ("services.scheduler", "services.tokenizer", "services.detokenizer", "gateway"):
            seen[module.split(".")[-1]] = sorted(p.cpu_affinity())
    assert len(seen) == 4
    io = everywhere if layout is None else sorted(layout.io_cpus)
    assert seen == {"scheduler": everywhere, "tokenizer": io, "detokenizer": io, "gateway": io}
    if layout is not None:
        assert f"--decode-threads {layout.decode_threads}" in stack.launcher.output()
