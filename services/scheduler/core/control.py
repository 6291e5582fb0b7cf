"""Operations on a running engine: pause / continue, abort all, weights from disk, profiling, LoRA
adapters.

Pausing happens in the step loop: a paused engine still takes its inbox every step (new requests
queue in `waiting`, aborts apply) but schedules nothing, so no prefill and no decode run. SGLang's
modes decide what happens to the running requests when the pause begins: `abort` ends every live
request (finish_reason abort), `retract` sends them back to the queue (KV into the prefix cache;
they recompute on continue), `in_place` leaves them and their KV alone.

A weight update drains instead of pausing: requests that have produced nothing wait in the queue,
the others keep decoding on the old weights until they finish (or are aborted first when asked),
then, under the step lock, the new weights are checked and copied in place, the prefix cache (KV of
the old weights) is flushed and weight_version changes. No request sees two sets of weights, unless
the caller paused with `retract` first (SGLang's partial rollout: they recompute on the new ones).
LoRA adapters load without stopping the steps: the files are read and checked outside the step lock,
and only the registration takes it. An unload is refused (FAILED_PRECONDITION) while a request here
still uses the adapter; the tokenizer waits for its requests before asking (services/tokenizer/lora.py).
Every call here is made from a gRPC worker thread, never the engine thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from ringserve.errors import FailedPrecondition, InvalidArgument, NotFound
from ringserve.message import LoraAdapter
from services.scheduler.core.profiler import ProfileOptions
from services.scheduler.model_executor import weight_update
from services.scheduler.model_executor.weight_update import WeightUpdateError

if TYPE_CHECKING:
    from services.scheduler.core.engine import Engine

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
DRAIN_TIMEOUT_S = 600.0
DRAIN_POLL_S = 0.02


class UpdateResult(NamedTuple):
    success: bool
    message: str
    num_paused_requests: int
    weight_version: str


def abort_all(engine: Engine, message: str) -> int:
    with engine.locked():
        gone = engine.scheduler.abort_all(message)
    for r in gone:
        log.info("rid=%s aborted (%s)", r.rid, message)
    engine.wake()
    return len(gone)


def pause(engine: Engine, mode: str) -> int:
    """Stop generating; returns the requests aborted, retracted or held (by mode)."""
    if mode not in PAUSE_MODES:
        raise InvalidArgument("mode", f"{mode!r} is not one of {', '.join(PAUSE_MODES)}")
    with engine.locked():
        s = engine.scheduler
        if mode == "abort":
            gone = s.abort_all("generation paused (abort)")
            n = len(gone)
        elif mode == "retract":
            n = s.retract_all()
        else:
            n = len(s.running) + (s.chunked is not None)
        engine.paused = mode
        engine._update_load()
    engine.wake()  # the aborts' finishes go out with the next (empty) step
    log.info("generation paused mode=%s requests=%d", mode, n)
    return n


def resume(engine: Engine) -> bool:
    with engine.locked():
        was, engine.paused = engine.paused, None
    engine.wake()
    if was:
        log.info("generation continued (was paused mode=%s)", was)
    return was is not None


def update_weights(engine: Engine, model_path: str, load_format: str = "", abort_all_requests: bool = False,
                   weight_version: str = "", drain_timeout_s: float = DRAIN_TIMEOUT_S) -> UpdateResult:
    """See the module doc. On failure the old weights and version stay and generation goes on."""
    version = engine.weight_version
    if load_format not in weight_update.LOAD_FORMATS:
        return UpdateResult(False, f"load_format: {load_format!r} is not supported (auto, safetensors)", 0, version)
    try:
        weight_update.check(engine.runner, model_path)  # fail fast, before anything waits
    except WeightUpdateError as e:
        return UpdateResult(False, str(e), 0, version)
    s = engine.scheduler
    with engine.locked():
        if engine.paused == "in_place" and s.num_started():
            return UpdateResult(False, f"paused in_place with {s.num_started()} running request(s) holding KV of "
                                       "the old weights; pause with mode retract or abort first", 0, version)
        s.hold_new = True
        if abort_all_requests:
            for r in s.abort_all("aborted for a weight update"):
                log.info("rid=%s aborted for a weight update", r.rid)
    engine.wake()
    try:
        end = time.monotonic() + (drain_timeout_s or DRAIN_TIMEOUT_S)
        while True:
            with engine.locked():
                busy = 0 if engine.paused else s.num_started()
                if not busy:
                    return _swap(engine, model_path, weight_version or model_path)
            if time.monotonic() >= end:
                return UpdateResult(False, f"{busy} running request(s) did not finish within {drain_timeout_s:.0f}s; "
                                           "retry with abort_all_requests", 0, version)
            engine.inbox.wait(DRAIN_POLL_S, busy=False)  # the engine steps meanwhile; recheck
    finally:
        with engine.locked():
            s.hold_new = False
        engine.wake()


def _swap(engine: Engine, model_path: str, version: str) -> UpdateResult:
    """Under the step lock: nothing has KV of the old weights but the prefix cache."""
    waiting = engine.scheduler.num_queued()
    try:
        weight_update.load_in_place(engine.runner, model_path)
    except (WeightUpdateError, KeyError, RuntimeError, OSError) as e:
        # check() passed, so this is a file that changed or broke while being read: the parameters
        # may be partly new. Say so rather than serve silently mixed weights.
        log.error("weight update from %s failed mid-copy: %s", model_path, e)
        return UpdateResult(False, f"{model_path}: failed while copying ({e}); the weights may be partly "
                                   "updated, update again", 0, engine.weight_version)
    engine.kv.flush()
    engine.scheduler.weight_version = version
    engine._update_load()
    log.info("weights updated from %s, version %s, %d request(s) waited", model_path, version, waiting)
    return UpdateResult(True, f"Succeeded to update model weights from {model_path}.", waiting, version)


def start_profile(engine: Engine, opts: ProfileOptions) -> str:
    opts = engine.profiler.validate(opts)
    engine.profiler.request(opts, engine.wake)
    return f"profiling {'+'.join(opts.activities)} to {opts.output_dir}"


def stop_profile(engine: Engine) -> list[str]:
    return engine.profiler.request(None, engine.wake)


def load_lora(engine: Engine, adapter: LoraAdapter) -> int:
    """Load an adapter (see the module doc); returns its rank. InvalidArgument / AlreadyExists /
    ResourceExhausted say why not."""
    lora = _lora(engine)
    weights = lora.read(adapter.name, adapter.path)  # slow: disk and checks, outside the step lock
    with engine.locked():  # pinning fills a slot the forward reads
        lora.add(weights, adapter.pinned)
        engine._update_load()
    return weights.rank


def unload_lora(engine: Engine, name: str) -> None:
    """Forget an adapter and free its cached KV; FailedPrecondition while a request here uses it."""
    lora = _lora(engine)
    with engine.locked():
        engine.recv()  # requests already submitted count as users (their adapter resolves in recv)
        uid = lora.resolve(name)
        users = [r.rid for r in engine.scheduler.live_reqs() if r.lora_uid == uid]
        if users:
            raise FailedPrecondition(f"lora_name: adapter {name!r} is in use by {len(users)} request(s) "
                                     f"here (e.g. {users[0]}); retry when they finish")
        lora.remove(name)
        freed = engine.tree.drop(uid)
        engine._update_load()
    log.info("lora adapter %s: %d cached token(s) of it freed", name, freed)


def _lora(engine: Engine):  # -> LoraManager
    if engine.lora is None:
        raise NotFound("this scheduler serves no LoRA adapters (start it with --enable-lora or --lora-paths)")
    return engine.lora
