"""Multi-LoRA through the real processes (tiny random model, random peft adapters).

- A batch mixing three adapters and the base model gives each request what it gets alone (and the
  adapters do change the output).
- The prefix cache never shares KV between adapters: the same prompt on another adapter reports no
  cached tokens.
- Load, use, unload, use again (404 naming it), over SGLang's and vLLM's routes; the adapter shows in
  /v1/models with its parent while loaded, and can be picked by `model` (vLLM's way).
- A broken adapter is a 400 naming lora_path, and a taken name a 409.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_operations import start_streams
from tests.lora_adapters import make_adapter

pytestmark = pytest.mark.e2e

PROMPTS = ["Once upon a time", "def fibonacci(n):", "上海 北京 深圳"]
NEW = 8


@pytest.fixture(scope="module")
def adapters(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {"a": make_adapter(model_dir, root / "a", seed=1, r=8),
            "b": make_adapter(model_dir, root / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"]),
            "c": make_adapter(model_dir, root / "c", seed=3, r=8, targets=["o_proj", "gate_proj", "up_proj"]),
            "late": make_adapter(model_dir, root / "late", seed=4, r=8)}


@pytest.fixture(scope="module")
def stack(model_dir: str, adapters: dict[str, str]) -> Iterator[Stack]:
    paths = [f"{n}={adapters[n]}" for n in ("a", "b", "c")]
    with running_stack(model_dir, "--lora-paths", *paths, "--max-lora-rank", "8") as s:
        yield s


def _gen(stack: Stack, prompt: str, lora: str | None, **extra) -> dict:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "min_new_tokens": NEW},
            **extra}
    if lora:
        body["lora_path"] = lora
    return stack.generate(body)


def test_mixed_batch_equals_alone(stack: Stack) -> None:
    cases = [(p, lora) for p in PROMPTS for lora in (None, "a", "b", "c")]
    alone = {c: _gen(stack, *c)["output_ids"] for c in cases}
    for p in PROMPTS:  # every adapter changes the output (B is not zero)
        assert len({tuple(alone[(p, lora)]) for lora in (None, "a", "b", "c")}) == 4, p
    # All at once, twice over: they share batches (prefill and decode) across adapters and the base.
    with cf.ThreadPoolExecutor(len(cases) * 2) as pool:
        futs = {pool.submit(_gen, stack, *c): c for c in cases * 2}
        for f in cf.as_completed(futs):
            assert f.result()["output_ids"] == alone[futs[f]], futs[f]


def test_prefix_cache_is_per_adapter(stack: Stack) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    first = _gen(stack, prompt, None)
    cached = _gen(stack, prompt, None)["meta_info"]["cached_tokens"]
    assert cached > 10  # the base model reuses its own
    on_a = _gen(stack, prompt, "a")
    assert on_a["meta_info"]["cached_tokens"] <= 1  # the BOS token at most, cached by a's earlier requests
    assert on_a["output_ids"] != first["output_ids"]
    assert _gen(stack, prompt, "a")["meta_info"]["cached_tokens"] > 0  # and an adapter its own


def test_load_use_unload_use_again(stack: Stack, adapters: dict[str, str]) -> None:
    url = stack.gateway_url
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"]["late"] == adapters["late"]
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    base = models[0]["id"]
    assert {"id": "late", "root": adapters["late"], "parent": base}.items() <= \
        next(m for m in models if m["id"] == "late").items()
    used = _gen(stack, PROMPTS[0], "late")["output_ids"]
    assert used != _gen(stack, PROMPTS[0], None)["output_ids"]
    # vLLM's way: the adapter's name as the model; the reply names it.
    comp = httpx.post(f"{url}/v1/completions", json={"model": "late", "prompt": PROMPTS[0], "max_tokens": NEW,
                                                      "min_tokens": NEW, "temperature": 0}, timeout=60)
    assert comp.status_code == 200, comp.text
    assert comp.json()["model"] == "late"
    # While streams on it run, the unload waits for them; they finish on the adapter.
    long = {"text": PROMPTS[0], "lora_path": "late", "sampling_params": {"temperature": 0, "max_new_tokens": 48,
                                                                           "min_new_tokens": 48}}
    streams = start_streams(stack, [long] * 3)
    for st in streams:
        assert st.started.wait(60) and not st.error, st.error  # each has produced tokens: it is in flight
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    for st in streams:
        assert st.done.wait(60) and not st.error, st.error
        assert st.output_ids[:NEW] == used and len(st.output_ids) == 48
    again = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "lora_path": "late"}, timeout=60)
    assert again.status_code == 404, again.text
    assert "late" in again.json()["error"]["message"]
    gone = httpx.post(f"{url}/v1/completions", json={"model": "late", "prompt": "x"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "late" not in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 404
    # Loaded again under the same name: served again.
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert _gen(stack, PROMPTS[0], "late")["output_ids"] == used


def test_bad_adapters_are_refused_naming_the_field(stack: Stack, adapters: dict[str, str], tmp_path: Path) -> None:
    url = stack.gateway_url
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=60)
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]}, timeout=60)
    assert r.status_code == 409, r.text
    r = httpx.post(f"{url}/generate", json={"text": "x", "lora_path": "nope"}, timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"], r.text
