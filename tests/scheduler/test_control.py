"""Operations on the in-process Engine: pause modes and continue, abort all, weights from disk
(checks, in-place swap, drain of running requests), profiling."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ringserve.errors import InvalidArgument
from ringserve.message import SamplingParams, StepBatch
from services.scheduler.config import EngineConfig
from services.scheduler.core import control
from services.scheduler.core.engine import Engine
from services.scheduler.core.profiler import ProfileError, ProfileOptions
from services.scheduler.core.req import Req

PROMPTS = [[5, 17, 300, 41, 9, 77], [8, 1200, 33, 6, 501, 62, 14], [90, 91, 92, 93]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def make_engine(model: str) -> Engine:
    e = Engine(EngineConfig(model=model, device="cpu", max_total_tokens=4000, max_running_requests=16))
    e.warmup()
    return e


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: str, model_dir_v2: str) -> dict[str, list[list[int]]]:
    """Greedy outputs of PROMPTS on each set of weights, from engines loaded directly."""
    out = {}
    for name, path in (("v1", model_dir), ("v2", model_dir_v2)):
        e = make_engine(path)
        out[name] = [r.output_ids for r in e.generate(PROMPTS, greedy(12))]
    assert out["v1"] != out["v2"]
    return out


def submit_all(engine: Engine, tag: str, n: int = 12) -> list[Req]:
    reqs = [Req(rid=f"{tag}-{i}", origin_input_ids=list(p), params=greedy(n), stream=True)
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.submit(r)
    return reqs


@contextmanager
def engine_thread(engine: Engine) -> Iterator[list[StepBatch]]:
    """The engine's own loop in a thread, as in the scheduler process; yields what it sends."""
    stop = threading.Event()
    sent: list[StepBatch] = []
    loop = threading.Thread(target=engine.run, args=(stop, lambda b, _r: sent.append(b)), daemon=True)
    loop.start()
    try:
        yield sent
    finally:
        stop.set()
        engine.wake()
        loop.join(10)


def step_until_done(engine: Engine, reqs: list[Req], limit: int = 200) -> None:
    for _ in range(limit):
        if all(r.finished for r in reqs):
            return
        engine.step()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_continue_gives_the_unpaused_output(engine: Engine, reference, mode: str) -> None:
    reqs = submit_all(engine, f"pause-{mode}")
    for _ in range(4):
        engine.step()
    n = control.pause(engine, mode)  # with overlap scheduling, the forward in flight finishes first
    assert n == len(PROMPTS)
    before = [len(r.output_ids) for r in reqs]
    assert any(before)
    if mode == "retract":
        assert not engine.scheduler.running and engine.kv.used_tokens() == engine.kv.tree.protected_size()
    for _ in range(5):
        engine.step()  # paused: intake only
    assert [len(r.output_ids) for r in reqs] == before
    assert not engine.wait_for_work(0.01)  # a paused engine with only held requests does not spin
    late = Req(rid=f"pause-{mode}-late", origin_input_ids=list(PROMPTS[0]), params=greedy(12))
    engine.submit(late)  # accepted and queued while paused
    engine.step()
    assert not late.output_ids
    assert control.resume(engine)
    step_until_done(engine, [*reqs, late])
    assert [r.output_ids for r in reqs] == reference["v1"]
    assert late.output_ids == reference["v1"][0]


def test_pause_abort_ends_every_request_with_a_reason(engine: Engine) -> None:
    reqs = submit_all(engine, "pause-abort")
    engine.step()
    assert control.pause(engine, "abort") == len(PROMPTS)
    assert engine.wait_for_work(0.01)  # the aborts' finishes still go out
    out = engine.step()
    assert {o.rid for o in out if o.finish is not None} == {r.rid for r in reqs}
    assert all(r.finished_reason.type == "abort" and "paused" in r.finished_reason.message for r in reqs)
    control.resume(engine)
    assert engine.kv.used_tokens() == engine.kv.tree.protected_size()


def test_pause_mode_is_checked(engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="mode"):
        control.pause(engine, "sideways")


def test_abort_all_emits_a_finish_for_every_live_request(engine: Engine) -> None:
    reqs = submit_all(engine, "abort-all", n=200)
    engine.step()
    assert control.abort_all(engine, "aborted by abort_all") == len(PROMPTS)
    out = engine.step()
    finishes = {o.rid: o.finish for o in out if o.finish is not None}
    assert set(finishes) == {r.rid for r in reqs}
    assert all(f.type == "abort" and f.message == "aborted by abort_all" for f in finishes.values())
    assert not engine.has_work()


def _bad_copy(src: str, tmp_path: Path, edit) -> str:
    out = tmp_path / "bad"
    shutil.copytree(src, out)
    edit(out)
    return str(out)


def test_update_refuses_other_shapes_and_keeps_the_old_weights(engine: Engine, model_dir: str, reference,
                                                               tmp_path: Path) -> None:
    def wider(p: Path) -> None:
        cfg = json.loads((p / "config.json").read_text())
        cfg["intermediate_size"] = 640
        (p / "config.json").write_text(json.dumps(cfg))

    r = control.update_weights(engine, _bad_copy(model_dir, tmp_path, wider))
    assert not r.success and "intermediate_size" in r.message and "config.json" in r.message

    def one_tensor_off(p: Path) -> None:
        from safetensors.numpy import load_file, save_file

        w = load_file(str(p / "model.safetensors"))
        w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"][:, :-1].copy()
        save_file(w, str(p / "model.safetensors"))

    shutil.rmtree(tmp_path / "bad")
    r = control.update_weights(engine, _bad_copy(model_dir, tmp_path, one_tensor_off))
    assert not r.success
    assert "model.safetensors" in r.message and "model.layers.1.mlp.up_proj.weight" in r.message
    assert control.update_weights(engine, str(tmp_path / "nowhere")).message.startswith("model_path")
    assert "load_format" in control.update_weights(engine, model_dir, load_format="pt").message
    assert engine.weight_version == "default"
    assert [r.output_ids for r in engine.generate(PROMPTS, greedy(12))] == reference["v1"]


def test_update_drains_running_requests_then_swaps(model_dir: str, model_dir_v2: str, reference) -> None:
    """Running requests finish on the old weights; one that arrives during the drain waits and runs
    on the new ones; the prefix cache is flushed; weight_version changes."""
    engine = make_engine(model_dir)
    with engine_thread(engine) as sent:
        old = submit_all(engine, "old", n=12)
        while not all(r.output_ids for r in old):
            engine.wait_idle(0.005)
        result: list[control.UpdateResult] = []
        updater = threading.Thread(target=lambda: result.append(
            control.update_weights(engine, model_dir_v2, weight_version="v2")))
        updater.start()
        while not engine.scheduler.hold_new and updater.is_alive():
            engine.inbox.wait(0.005, busy=False)
        new = Req(rid="new", origin_input_ids=list(PROMPTS[1]), params=greedy(12))
        engine.submit(new)
        updater.join(60)
        assert result and result[0].success, result
        assert result[0].weight_version == engine.weight_version == "v2"
        assert engine.wait_idle(60)
        assert [r.output_ids for r in old] == reference["v1"]
        assert new.output_ids == reference["v2"][1]
        assert engine.kv.tree.total_size() <= len(PROMPTS[1]) + 12  # only what ran after the flush
        def finishes() -> dict[str, str]:
            return {d.rid: d.weight_version for b in list(sent) for d in b.deltas if d.finish is not None}

        for _ in range(500):  # the loop sends a step's batch just after the step
            if "new" in finishes():
                break
            engine.inbox.wait(0.01, busy=False)
        assert finishes() == {**{r.rid: "default" for r in old}, "new": "v2"}


def test_update_with_abort_all_requests(model_dir: str, model_dir_v2: str, reference) -> None:
    engine = make_engine(model_dir)
    reqs = submit_all(engine, "ab", n=500)
    engine.step()
    r = control.update_weights(engine, model_dir_v2, abort_all_requests=True)
    assert r.success, r.message
    assert all(q.finished_reason.type == "abort" and "weight update" in q.finished_reason.message for q in reqs)
    assert engine.weight_version == model_dir_v2  # no label given: the path
    engine.step()  # sends the finishes
    assert [x.output_ids for x in engine.generate(PROMPTS, greedy(12))] == reference["v2"]


def test_profile_for_a_number_of_steps_writes_a_chrome_trace(engine: Engine, tmp_path: Path) -> None:
    with engine_thread(engine):
        msg = control.start_profile(engine, ProfileOptions(output_dir=str(tmp_path), num_steps=3,
                                                           activities=["CPU"], profile_prefix="t-"))
        assert str(tmp_path) in msg
        with pytest.raises(ProfileError, match="already profiling"):
            control.start_profile(engine, ProfileOptions(output_dir=str(tmp_path)))
        reqs = submit_all(engine, "prof", n=6)
        while not all(r.finished for r in reqs):
            engine.wait_idle(0.05)
        assert not engine.profiler.active  # stopped by itself after 3 steps
        written = list(engine.profiler.last_files)
        assert len(written) == 1
        assert control.stop_profile(engine) == written  # it had stopped by itself: its files
        # until stopped
        control.start_profile(engine, ProfileOptions(output_dir=str(tmp_path), activities=["CPU"],
                                                     profile_prefix="u-"))
        reqs = submit_all(engine, "prof2", n=4)
        while not all(r.finished for r in reqs):
            engine.wait_idle(0.05)
        assert len(control.stop_profile(engine)) == 1
    assert list(tmp_path.glob("u-*.pt.trace.json"))
    files = list(tmp_path.glob("t-*.pt.trace.json"))
    assert len(files) == 1
    trace = json.loads(files[0].read_text())
    assert any(ev.get("name", "").startswith("aten::") for ev in trace["traceEvents"])
    with pytest.raises(InvalidArgument, match="activities"):
        control.start_profile(engine, ProfileOptions(activities=["TPU"]))


def test_update_in_bf16_repacks_every_linear(model_dir: str, model_dir_v2: str) -> None:
    """With bf16 linears (weights held only in bf16 and packed), an update in place serves exactly what
    an engine loaded on the new weights serves (the tied lm_head's copy: test_cpu_linear)."""
    from services.scheduler.kernels import cpu_linear

    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")

    def bf16_engine(path: str) -> Engine:
        return Engine(EngineConfig(model=path, device="cpu", dtype="bfloat16", max_total_tokens=4000,
                                   max_running_requests=16))

    want = [r.output_ids for r in bf16_engine(model_dir_v2).generate(PROMPTS, greedy(12))]
    engine = bf16_engine(model_dir)
    assert [r.output_ids for r in engine.generate(PROMPTS, greedy(12))] != want
    assert control.update_weights(engine, model_dir_v2).success
    assert [r.output_ids for r in engine.generate(PROMPTS, greedy(12))] == want
