"""Overlap scheduling through the four real processes: concurrent greedy requests (mixed max tokens, a
stop string, an EOS, n > 1) through a stack with overlap forced on (--no-disable-overlap-schedule) give
the same ids and finish reasons as the in-process Engine with overlap off on the same prompt ids, and
get_server_info says overlap is on. The lag itself is tested in-process, on and off
(tests/scheduler/test_overlap.py); one stack and an in-process reference instead of a second stack
keep this test cheap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ringserve.message import SamplingParams
from ringserve.message.finish import Finish
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


def engine_reference(model_dir: str, tok: TextTokenizer, reqs: list[dict]) -> list[Output]:
    """The same requests (n expanded as the tokenizer does) on the in-process Engine, overlap off, all
    submitted at once; (text, ids, finish) per sample, text as the detokenizer would decode the ids."""
    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine

    engine = Engine(EngineConfig(model=model_dir, device="cpu", disable_overlap_schedule=True))
    prompts, params, owner = [], [], []
    for k, body in enumerate(reqs):
        sp = dict(body["sampling_params"])
        n = sp.pop("n", 1)
        sp["stop"] = tuple(sp.get("stop", ()))
        sp["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in sp.get("logit_bias", {}).items()))
        for _ in range(n):
            prompts.append(tok.encode(body["text"]))
            params.append(SamplingParams(**sp))
            owner.append(k)
    out: list[Output] = [[] for _ in reqs]
    for k, r in zip(owner, engine.generate(prompts, params), strict=True):
        out[k].append(("", r.output_ids, finish_json(r.finish, len(r.output_ids))))
    return out


def finish_json(f: Finish | None, completion_tokens: int) -> dict:
    """The gateway's meta_info.finish_reason for a finish (gateway/convert.py: native_finish_reason)."""
    assert f is not None
    if f.type == "length":
        return {"type": "length", "length": completion_tokens}
    assert f.type == "stop", f
    return {"type": "stop", "matched": f.matched_token if f.matched_token is not None else f.matched_str}


def test_overlap_on_through_the_stack_equals_the_engine_with_overlap_off(model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    eos = tok.eos_token_ids[0]
    reqs = bodies(eos)
    # On CPU overlap is off by default: the stack forces it on.
    with running_stack(model_dir, "--no-disable-overlap-schedule") as stack:
        got = run_all(stack.gateway_url, reqs)
        assert "overlap schedule: on" in stack.launcher.output()
        info = httpx.get(f"{stack.gateway_url}/get_server_info", timeout=10).json()
        assert [s.get("overlap_schedule", False) for s in info["schedulers"]] == [True]
    want = engine_reference(model_dir, tok, reqs)
    # ids and finish reasons equal the reference's; the text is what those ids decode to.
    assert [[(ids, fin) for _, ids, fin in o] for o in got] == [[(ids, fin) for _, ids, fin in o] for o in want]
    for (text, ids, fin), body in zip((o[0] for o in got), reqs):
        if fin["type"] == "length":
            assert text == tok.decode(ids), body
    first = got
    assert first[0][0][2]["type"] == "length" and len(first[0][0][1]) == 4
    assert first[1][0][2]["type"] == "stop" and first[2][0][1][-1] == eos and len(first[2][0][1]) == 4
    assert len(first[3]) == 3 and first[3][0] == first[3][1] == first[3][2]  # n=3 greedy: three equal
