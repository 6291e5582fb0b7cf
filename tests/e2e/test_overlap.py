"""Overlap scheduling through the four real processes: the same concurrent greedy requests (mixed
max tokens, a stop string, an EOS, n > 1) give the same output with overlap on and off
(--[no-]disable-overlap-schedule), and get_server_info says which. The lag itself is tested
in-process (tests/scheduler/test_overlap.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ringserve.text_tokenizer import TextTokenizer
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.e2e

PROMPTS = ["The scheduler decides every finish", "Once upon a time", "1 2 3 4 5", "你好，世界",
           "def step(self):", "The quick brown fox", "a", "Tokens travel as packed integers"]


def bodies(eos: int) -> list[dict]:
    out = []
    for i, text in enumerate(PROMPTS):
        sp: dict = {"temperature": 0, "max_new_tokens": 4 + 5 * i, "ignore_eos": True}
        if i == 1:
            sp = {"temperature": 0, "max_new_tokens": 40, "stop": [" the", "e"]}
        if i == 2:  # EOS at its fourth token: the bias forces it once the three before are out
            sp = {"temperature": 0, "max_new_tokens": 30, "min_new_tokens": 3, "logit_bias": {str(eos): 50}}
        if i == 3:
            sp = {**sp, "n": 3}
        out.append({"text": text, "sampling_params": sp})
    return out


Output = list[tuple[str, list[int], dict]]  # per sample: text, ids, finish_reason


def run_all(url: str, reqs: list[dict]) -> list[Output]:
    """All at once (they batch together in the scheduler); each one's ids and finish."""
    def one(body: dict) -> Output:
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        r.raise_for_status()
        res = r.json()
        items = res if isinstance(res, list) else [res]
        return [(x["text"], x["output_ids"], x["meta_info"]["finish_reason"]) for x in items]

    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def test_greedy_output_is_the_same_with_overlap_on_and_off(model_dir: str) -> None:
    eos = TextTokenizer.from_model(model_dir).eos_token_ids[0]
    reqs = bodies(eos)
    got = {}
    for on in (True, False):  # on CPU it is off by default: both set explicitly
        with running_stack(model_dir, "--no-disable-overlap-schedule" if on else "--disable-overlap-schedule") as stack:
            got[on] = run_all(stack.gateway_url, reqs)
            assert f"overlap schedule: {'on' if on else 'off'}" in stack.launcher.output()
            info = httpx.get(f"{stack.gateway_url}/get_server_info", timeout=10).json()
            assert [s.get("overlap_schedule", False) for s in info["schedulers"]] == [on]
    assert got[True] == got[False]
    first = got[True]
    assert first[0][0][2]["type"] == "length" and len(first[0][0][1]) == 4
    assert first[1][0][2]["type"] == "stop" and first[2][0][1][-1] == eos and len(first[2][0][1]) == 4
    assert len(first[3]) == 3 and first[3][0] == first[3][1] == first[3][2]  # n=3 greedy: three equal
