"""Chaos under real load: services killed (SIGKILL) at random moments while streams run, with
invariants checked after every round. Seeded: the same seed replays the same rounds (request mix,
victims, kill and restart moments; the services' own timing still varies).

The ring: one detokenizer, one scheduler (chunked prefill on, so long prompts take several
steps), two tokenizer replicas, one gateway on the first. This harness is the supervisor: it kills
a service and starts it again on the same port after a short seeded delay, as a restart policy would.

A round starts a mix of streaming requests (greedy and sampled, stop strings, n > 1, CJK and emoji,
long prompts; through the gateway's SSE or a tokenizer's gRPC), kills one service at a random
moment, restarts it, waits for every request, then checks:
  - every request completed, or ended with an explicit error (gRPC status, HTTP error, broken
    connection), within its deadline: none hangs;
  - a completed stream's text equals decode(output_ids) (up to the matched stop string), and a
    greedy one's ids equal the same request's ids in a run without faults;
  - no U+FFFD appeared mid-stream (unless the final text has it: invalid bytes the model chose);
  - the ring returns to idle: each tokenizer's rid_to_state, the scheduler's running batch and
    queue empty, and after a cache flush no KV token is in use.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx

from ringserve.process import wait_grpc_serving
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.resilience.cluster import Cluster, Svc, cluster, eventually, rid_to_state_size, scheduler_load

VICTIMS = ("detokenizer", "scheduler", "tokenizer", "gateway")
REQUEST_DEADLINE_S = 240.0  # generous: the machine is shared and a restart reloads a model
CHUNKED_PREFILL = 64
PROMPTS = [
    "用中文写一首关于春天的短诗。",
    "東京の天気について教えてください 😀",
    "List three emoji and what they mean: 🚀 🎉 👍🏽",
    "한국어로 인사해 주세요. 안녕하세요!",
    "Tell me a story about a fox 🦊 who learns Chinese: 你好，狐狸。",
]
LONG_PROMPT = ("Summarize the following notes. 机器学习是人工智能的一个分支。 Emoji 😀🚀. " * 12).strip()


BASELINE_TOKENS = 32  # the fault-free greedy run of each prompt; every greedy request is a prefix of it


@dataclass
class Spec:
    """One request of a round, all of it drawn from the round's seed."""

    key: str
    prompt: str
    max_new_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    n: int
    via: str  # "gateway" (HTTP SSE) or "tok0"/"tok1" (gRPC)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Outcome:
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    matched_str: dict[int, str] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    error: str = ""
    fffd_mid_stream: set[int] = field(default_factory=set)  # samples that had U+FFFD before their end
    done: threading.Event = field(default_factory=threading.Event)


def draw_specs(rng: random.Random, round_no: int, count: int) -> list[Spec]:
    specs = []
    for i in range(count):
        long = rng.random() < 0.2
        greedy = rng.random() < 0.5
        specs.append(Spec(
            key=f"{round_no}-{i}", prompt=LONG_PROMPT if long else rng.choice(PROMPTS),
            max_new_tokens=rng.choice((16, 24, BASELINE_TOKENS)), temperature=0.0 if greedy else 0.8,
            seed=None if greedy else rng.randrange(1 << 30),
            stop=rng.choice(((), (), ("。",), ("\n\n", "!"))), n=rng.choice((1, 1, 1, 2)),
            via=rng.choice(("gateway", "tok0", "tok1"))))
    return specs


def _sampling(spec: Spec) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                   stop=list(spec.stop), n=spec.n)
    if spec.seed is not None:
        sp.seed = spec.seed
    return sp


def run_grpc(target: str, spec: Spec, out: Outcome) -> None:
    try:
        with grpc.insecure_channel(target) as ch:
            stub = api_pb2_grpc.InferenceServiceStub(ch)
            req = api_pb2.GenerateRequest(text=spec.prompt, stream=True, sampling_params=_sampling(spec))
            for msg in stub.Generate(req, timeout=REQUEST_DEADLINE_S):
                i = msg.index
                if "\ufffd" in msg.text and not msg.finished:
                    out.fffd_mid_stream.add(i)
                out.texts[i] = out.texts.get(i, "") + msg.text
                out.ids.setdefault(i, []).extend(msg.output_ids)
                if msg.finished:
                    out.finished.add(i)
                    out.matched_str[i] = msg.meta_info.finish_reason.matched_str
    except grpc.RpcError as e:
        out.error = f"grpc {e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - any other failure is an explicit error too, recorded
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done.set()


def run_sse(url: str, spec: Spec, out: Outcome) -> None:
    body = {"text": spec.prompt, "stream": True, "sampling_params": {
        "max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature, "stop": list(spec.stop),
        "n": spec.n, **({"seed": spec.seed} if spec.seed is not None else {})}}
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=REQUEST_DEADLINE_S) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    out.error = f"SSE error: {ev['error']}"
                    return
                i = ev.get("index", 0)
                text = ev.get("text", "")  # the native API streams the whole text so far
                meta = ev.get("meta_info", {})
                fin = meta.get("finish_reason")
                if "\ufffd" in text and not fin:
                    out.fffd_mid_stream.add(i)
                out.texts[i] = text
                out.ids[i] = list(ev.get("output_ids", []))
                if fin:
                    out.finished.add(i)
                    out.matched_str[i] = fin.get("matched", "") if isinstance(fin.get("matched"), str) else ""
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done.set()


def expected_text(tok: TextTokenizer, ids: list[int], matched: str) -> str:
    full = tok.decode(ids)
    if matched and matched in full:
        return full[:full.index(matched)]  # the stop string and what follows are trimmed
    return full


@dataclass
class Report:
    seed: int
    rounds: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    errored: Counter[str] = field(default_factory=Counter)
    greedy_compared: int = 0
    fffd_in_output: int = 0  # samples whose output itself has U+FFFD (invalid bytes sampled): not a fault
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kills = ", ".join(f"{v} {self.kills[v]}" for v in VICTIMS)
        errs = ", ".join(f"{k} {v}" for k, v in self.errored.most_common(4)) or "none"
        return (f"chaos seed={self.seed}: {self.rounds} rounds; kills survived: {kills}; requests "
                f"completed {self.completed} (greedy ids compared {self.greedy_compared}), ended with an "
                f"explicit error {sum(self.errored.values())} ({errs}); U+FFFD in the output itself "
                f"{self.fffd_in_output}; invariant violations "
                f"{len(self.violations)}")


class Chaos:
    def __init__(self, c: Cluster, tok: TextTokenizer, seed: int) -> None:
        self.c = c
        self.tok = tok
        self.report = Report(seed)
        self.detok = c.detokenizer()
        self.sched = c.scheduler(self.detok, "--chunked-prefill-size", str(CHUNKED_PREFILL))
        self.toks = [c.tokenizer(self.sched, self.detok, name=f"tokenizer-{i}") for i in range(2)]
        self.gw = c.gateway(self.toks[0])
        self.baseline: dict[str, list[int]] = {}  # prompt -> fault-free greedy ids

    def svc(self, victim: str) -> Svc:
        if victim == "tokenizer":
            return self.toks[self.report.kills[victim] % len(self.toks)]
        return {"detokenizer": self.detok, "scheduler": self.sched, "gateway": self.gw}[victim]

    def start(self, spec: Spec) -> tuple[Outcome, threading.Thread]:
        out = Outcome()
        if spec.via == "gateway":
            t = threading.Thread(target=run_sse, args=(self.gw.url, spec, out), daemon=True)
        else:
            t = threading.Thread(target=run_grpc, args=(self.toks[int(spec.via[-1])].target, spec, out),
                                 daemon=True)
        t.start()
        return out, t

    def run_specs(self, specs: list[Spec], victim: str | None, kill_at: float,
                  restart_after: float) -> list[Outcome]:
        started = time.monotonic()
        runs = [self.start(s) for s in specs]
        if victim is not None:
            time.sleep(kill_at)  # the fault's moment (drawn from the seed), not a readiness wait
            svc = self.svc(victim)
            svc.proc.signal(signal.SIGKILL)
            assert svc.proc.proc is not None
            svc.proc.proc.wait(30)
            time.sleep(restart_after)  # the restart policy's delay, drawn from the seed
            svc.proc.start()
            if victim == "gateway":
                svc.proc.wait_ready_line(180)
            else:
                svc.proc.wait_serving(svc.target, 180)
            self.report.kills[victim] += 1
        for _, t in runs:
            t.join(max(1.0, REQUEST_DEADLINE_S + 30 - (time.monotonic() - started)))
        return [out for out, _ in runs]

    def check(self, specs: list[Spec], outs: list[Outcome], round_no: int, victim: str | None) -> None:
        where = f"round {round_no} (kill {victim})"
        for spec, out in zip(specs, outs, strict=True):
            if not out.done.is_set():
                self.report.violations.append(f"{where} {spec.key}: no end within its deadline")
                continue
            if out.error:
                self.report.errored[out.error.split(":")[0]] += 1
                continue
            if out.finished != set(range(spec.n)):
                self.report.violations.append(f"{where} {spec.key}: stream ended without every finish "
                                              f"({sorted(out.finished)} of n={spec.n})")
                continue
            self.report.completed += 1
            for i in range(spec.n):
                want = expected_text(self.tok, out.ids[i], out.matched_str.get(i, ""))
                if i in out.fffd_mid_stream:
                    # Legitimate only where the whole output has it too: bytes the model sampled that
                    # no later byte can complete (the detokenizer sends U+FFFD only once text follows).
                    if "\ufffd" in want:
                        self.report.fffd_in_output += 1
                    else:
                        self.report.violations.append(f"{where} {spec.key}[{i}]: U+FFFD mid-stream")
                if out.texts[i] != want:
                    self.report.violations.append(f"{where} {spec.key}[{i}] via {spec.via}: text "
                                                  f"{out.texts[i][:80]!r} != decode {want[:80]!r}")
                base = self.baseline.get(spec.prompt)
                if spec.greedy and base is not None:
                    # Same prompt, greedy: the same ids as the fault-free run, up to where this one
                    # stopped (its max_new_tokens, a stop string, EOS).
                    self.report.greedy_compared += 1
                    if not out.ids[i] or out.ids[i] != base[:len(out.ids[i])]:
                        self.report.violations.append(f"{where} {spec.key}[{i}]: greedy ids differ from "
                                                      f"the fault-free run: {out.ids[i][:12]} vs {base[:12]}")

    def wait_idle(self, round_no: int) -> None:
        """Idle, and every service serving again (the next round must not meet a tokenizer still
        reconnecting to a restarted scheduler: its requests would be refused, not exercised)."""
        try:
            for t in self.toks:
                wait_grpc_serving(t.target, 180)
            eventually(self._gateway_healthy, 180, "gateway healthy", every=0.5)
            for t in self.toks:
                eventually(_empty_rid_to_state(t.target), 60, f"{t.proc.name} rid_to_state empty")
            eventually(lambda: (ld := scheduler_load(self.sched.target)).num_running_reqs == 0
                       and ld.num_queue_reqs == 0, 60, "scheduler running batch and queue empty")
            eventually(self._flush_and_check_kv, 60, "KV pool empty after a cache flush", every=1.0)
        except (AssertionError, TimeoutError, RuntimeError) as e:
            self.report.violations.append(f"round {round_no}: not idle: {e}")

    def _gateway_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.gw.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _flush_and_check_kv(self) -> bool:
        with grpc.insecure_channel(self.sched.target) as ch:
            ok = scheduler_pb2_grpc.SchedulerServiceStub(ch).FlushCache(
                scheduler_pb2.SchedulerServiceFlushCacheRequest(), timeout=30).success
        return ok and scheduler_load(self.sched.target).num_used_tokens == 0

    def calibrate(self) -> None:
        """The fault-free run: each prompt's greedy ids, the reference for the rounds with faults."""
        specs = [Spec(f"base-{i}", p, BASELINE_TOKENS, 0.0, None, (), 1, "tok0")
                 for i, p in enumerate([*PROMPTS, LONG_PROMPT])]
        for spec, out in zip(specs, self.run_specs(specs, None, 0, 0), strict=True):
            if out.error or out.finished != {0}:
                self.report.violations.append(f"calibration {spec.key}: {out.error or 'did not finish'}")
                continue
            self.baseline[spec.prompt] = out.ids[0]
        self.wait_idle(-1)

    def run(self, duration_s: float, per_round: int, min_rounds: int = len(VICTIMS)) -> Report:
        """Rounds until duration_s has passed and at least min_rounds ran (each kind once: 4)."""
        self.calibrate()
        end = time.monotonic() + duration_s
        r = 0
        while r < min_rounds or time.monotonic() < end:
            # Round r's draws depend on the seed and r only, never on timing: a seed replays.
            rng = random.Random(f"{self.report.seed}-{r}")
            specs = draw_specs(rng, r, per_round)
            victim = VICTIMS[r % len(VICTIMS)]  # each kind in turn, so every kind is exercised
            kill_at, restart_after = rng.uniform(0.2, 3.0), rng.uniform(0.0, 2.0)
            outs = self.run_specs(specs, victim, kill_at, restart_after)
            self.check(specs, outs, r, victim)
            self.wait_idle(r)
            self.report.rounds += 1
            print(f"round {r}: kill {victim} at {kill_at:.1f}s; {self.report.summary()}", flush=True)
            r += 1
        return self.report


def _empty_rid_to_state(target: str) -> Callable[[], bool]:
    return lambda: rid_to_state_size(target) == 0


@contextmanager
def chaos_ring(model: str, seed: int) -> Iterator[Chaos]:
    tok = TextTokenizer.from_model(model)
    with cluster(model) as c:
        yield Chaos(c, tok, seed)
