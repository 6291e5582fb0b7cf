"""`make run`: start detokenizer -> scheduler -> tokenizer -> gateway as four OS processes.

Each service is started with the same command its container runs, and only once the previous one
reports SERVING (grpc.health.v1 Watch; the gateway prints a readiness line). A service that exits
unexpectedly is restarted with exponential backoff, like a container restart policy. Ctrl-C or
SIGTERM stops everything in reverse order (each service drains on SIGTERM).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ringserve import cpu_layout
from ringserve.config import env_name, parse_config
from ringserve.cpu_layout import CpuLayout
from ringserve.logs import setup_logging
from ringserve.model_source import (
    architectures,
    exit_on_model_error,
    parameter_count,
    require_files,
    resolve_model,
    with_tokenizer,
)
from ringserve.process import ServiceProcess, python_cmd
from ringserve.text_tokenizer import default_model

log = logging.getLogger("launcher")
# About how long a restarted detokenizer takes to serve again (tokenizer load), for the grace check.
DETOKENIZER_START_S = 10.0


@dataclass(frozen=True)
class LauncherConfig:
    """Run the four ringserve services locally."""

    model: str = field(default_factory=default_model, metadata={"help": (
        "model directory, .gguf file, smollm2-135m-instruct (default), tiny, or a hub id")})
    tokenizer_path: str = field(default="", metadata={"help": (
        "a tokenizer directory to serve the model with instead of its own (or the GGUF's)")})
    host: str = field(default="127.0.0.1", metadata={"help": "address every service binds"})
    gateway_port: int = 30000
    tokenizer_port: int = 50051
    scheduler_port: int = 50052
    detokenizer_port: int = 50053
    tokenizer_metrics_port: int = 9091
    scheduler_metrics_port: int = 9092
    detokenizer_metrics_port: int = 9093
    startup_timeout_s: float = field(default=600.0, metadata={"help": "per service, model load included"})
    restart: bool = field(default=True, metadata={"help": "restart a service that exits"})
    restart_backoff_s: float = field(default=1.0, metadata={"help": "wait before the first restart; doubles "
                                                                    "per crash up to --max-backoff-s"})
    max_backoff_s: float = field(default=30.0, metadata={"help": (
        "longest wait before a restart; keep it below the tokenizer's --detokenizer-grace-s")})
    backoff_reset_s: float = field(default=10.0, metadata={"help": (
        "a service that stayed ready this long after a (re)start gets --restart-backoff-s again at its "
        "next crash")})
    io_cores: int = field(default=-1, metadata={"help": (
        "cores kept for the gateway, tokenizer and detokenizer when the scheduler runs on CPU: they are "
        "pinned there and its decode steps use the other cores; 0: no pinning; -1: one per 8 cores (at "
        "least one) for a model under 50M parameters, one per 64 for larger ones (none on fewer cores)")})
    chat_template: str = field(default="", metadata={"help": "the tokenizer's --chat-template (a file or the text)"})
    tool_call_parser: str = field(default="", metadata={"help": "the tokenizer's --tool-call-parser"})
    reasoning_parser: str = field(default="", metadata={"help": "the tokenizer's --reasoning-parser"})
    # SGLang's launch_server takes the LoRA flags at the top level; here they are the scheduler's.
    lora_paths: tuple[str, ...] = field(default=(), metadata={"help": (
        "LoRA adapters (PEFT directories) to serve from the start, each NAME=PATH (the scheduler's)")})
    enable_lora: bool = field(default=False, metadata={"help": "serve adapters loaded at run time (the scheduler's)"})
    max_loras_per_batch: int | None = field(default=None, metadata={"help": "the scheduler's --max-loras-per-batch"})
    max_lora_rank: int | None = field(default=None, metadata={"help": "the scheduler's --max-lora-rank"})
    lora_target_modules: tuple[str, ...] = field(default=(), metadata={"help": (
        "the scheduler's --lora-target-modules")})
    disable_overlap_schedule: bool | None = field(default=None, metadata={"help": (
        "the scheduler's --[no-]disable-overlap-schedule (default: its own, overlap on CUDA only)")})
    scheduler_args: str = field(default="", metadata={"help": "extra flags for the scheduler"})
    tokenizer_args: str = field(default="", metadata={"help": "extra flags for the tokenizer"})
    detokenizer_args: str = field(default="", metadata={"help": "extra flags for the detokenizer"})
    gateway_args: str = field(default="", metadata={"help": "extra flags for the gateway"})

    def __post_init__(self) -> None:
        if self.restart_backoff_s <= 0:
            raise ValueError("--restart-backoff-s must be > 0")
        if self.max_backoff_s < self.restart_backoff_s:
            raise ValueError("--max-backoff-s must be >= --restart-backoff-s")
        if self.backoff_reset_s < 0:
            raise ValueError("--backoff-reset-s must be >= 0")


@dataclass
class Managed:
    """A service under supervision, with how to know it is ready."""

    proc: ServiceProcess
    grpc_target: str | None  # None: wait for the readiness line (the gateway)
    restarts: int = 0


def service_commands(cfg: LauncherConfig, layout: CpuLayout | None = None
                     ) -> list[tuple[str, list[str], str | None]]:
    """(name, command, gRPC health target) in start order."""
    h = cfg.host
    # Before the user's own flags, so that an explicit --decode-threads wins.
    threads = ["--decode-threads", str(layout.decode_threads)] if layout else []
    overlap = ([] if cfg.disable_overlap_schedule is None else
               ["--disable-overlap-schedule" if cfg.disable_overlap_schedule else "--no-disable-overlap-schedule"])
    detok = f"{h}:{cfg.detokenizer_port}"
    sched = f"{h}:{cfg.scheduler_port}"
    tok = f"{h}:{cfg.tokenizer_port}"
    m = ["--model", cfg.model]
    # SGLang's launch_server takes these at the top level; here they are the tokenizer's.
    passed = (("--chat-template", cfg.chat_template), ("--tool-call-parser", cfg.tool_call_parser),
              ("--reasoning-parser", cfg.reasoning_parser))
    chat = [arg for flag, value in passed if value for arg in (flag, value)]
    lora = ([*(["--lora-paths", *cfg.lora_paths] if cfg.lora_paths else []),
             *(["--enable-lora"] if cfg.enable_lora else []),
             *(["--lora-target-modules", *cfg.lora_target_modules] if cfg.lora_target_modules else [])]
            + [arg for flag, value in (("--max-loras-per-batch", cfg.max_loras_per_batch),
                                       ("--max-lora-rank", cfg.max_lora_rank))
               if value is not None for arg in (flag, str(value))])
    return [
        ("detokenizer", python_cmd("services.detokenizer", "--host", h, "--port", str(cfg.detokenizer_port),
                                   "--metrics-port", str(cfg.detokenizer_metrics_port), *m,
                                   *shlex.split(cfg.detokenizer_args)), detok),
        ("scheduler", python_cmd("services.scheduler", "--host", h, "--port", str(cfg.scheduler_port),
                                 "--metrics-port", str(cfg.scheduler_metrics_port), *m,
                                 "--detokenizer", detok, *threads, *lora, *overlap,
                                 *shlex.split(cfg.scheduler_args)), sched),
        ("tokenizer", python_cmd("services.tokenizer", "--host", h, "--port", str(cfg.tokenizer_port),
                                 "--metrics-port", str(cfg.tokenizer_metrics_port), *m,
                                 "--scheduler", sched, "--detokenizer", detok, *chat,
                                 *shlex.split(cfg.tokenizer_args)), tok),
        ("gateway", python_cmd("gateway", "--host", h, "--port", str(cfg.gateway_port), "--tokenizer", tok,
                               *shlex.split(cfg.gateway_args)), None),
    ]


class RestartBackoff:
    """How long to wait before restarting a service that exited.

    Doubles from `first_s` up to `max_s` while the service keeps crashing (a crash loop must not spin),
    and starts over at `first_s` when the service had been ready for `reset_after_s` before it exited:
    a service that crashes now and then, with healthy service between, comes back in about `first_s`
    each time rather than ever more slowly (kills 20 s apart used to reach the 30 s ceiling by the
    sixth, and a 30 s outage is exactly what the tokenizer's detokenizer grace does not survive).
    """

    def __init__(self, first_s: float, max_s: float, reset_after_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.reset_after_s = reset_after_s
        self._next = first_s

    def next(self, healthy_s: float) -> float:
        """The wait before this restart, given how long the service was ready before it exited."""
        if healthy_s >= self.reset_after_s:
            self._next = self.first_s
        wait = min(self._next, self.max_s)
        self._next = min(self._next * 2, self.max_s)
        return wait


class Launcher:
    def __init__(self, cfg: LauncherConfig) -> None:
        self.cfg = cfg
        self.stopping = threading.Event()
        self.services: list[Managed] = []
        self.layout = cpu_layout.plan(cfg.io_cores, cpu_layout.scheduler_on_cpu(cfg.scheduler_args),
                                      model_params=parameter_count(Path(cfg.model)))

    def _wait_ready(self, svc: Managed) -> None:
        if svc.grpc_target is not None:
            svc.proc.wait_serving(svc.grpc_target, self.cfg.startup_timeout_s)
        else:
            svc.proc.wait_ready_line(self.cfg.startup_timeout_s)

    def start_all(self) -> None:
        if self.layout is not None:
            log.info("CPU layout: gateway, tokenizer and detokenizer on cores %s; scheduler decode on %d "
                     "threads", ",".join(map(str, sorted(self.layout.io_cpus))), self.layout.decode_threads)
        for name, cmd, target in service_commands(self.cfg, self.layout):
            log.info("starting %s: %s", name, shlex.join(cmd))
            cpus = self.layout.io_cpus if self.layout is not None and name != "scheduler" else None
            svc = Managed(ServiceProcess(name, cmd, cpus=cpus).start(), target)
            self.services.append(svc)
            t0 = time.monotonic()
            self._wait_ready(svc)
            log.info("%s ready in %.1fs", name, time.monotonic() - t0)
        for svc in self.services:
            threading.Thread(target=self._supervise, args=(svc,), daemon=True, name=svc.proc.name).start()

    def _supervise(self, svc: Managed) -> None:
        """Restart `svc` whenever it exits, after a backoff (RestartBackoff) that grows while it keeps
        crashing and starts over once it has served for backoff_reset_s."""
        policy = RestartBackoff(self.cfg.restart_backoff_s, self.cfg.max_backoff_s, self.cfg.backoff_reset_s)
        ready_at: float | None = time.monotonic()  # start_all waited for it to be ready
        while not self.stopping.is_set():
            assert svc.proc.proc is not None
            code = svc.proc.proc.wait()
            if self.stopping.is_set() or not self.cfg.restart:
                if not self.stopping.is_set():
                    log.error("%s exited with %s; restart disabled", svc.proc.name, code)
                return
            healthy_s = time.monotonic() - ready_at if ready_at is not None else 0.0
            backoff = policy.next(healthy_s)
            log.warning("%s exited with %s after %.0fs ready; restarting in %.1fs", svc.proc.name, code,
                        healthy_s, backoff)
            if self.stopping.wait(backoff):
                return
            svc.restarts += 1
            svc.proc.start()
            try:
                self._wait_ready(svc)
                ready_at = time.monotonic()
                log.info("%s back (restart %d)", svc.proc.name, svc.restarts)
            except (TimeoutError, RuntimeError) as e:
                ready_at = None  # never ready: the next crash counts as a crash loop
                log.error("%s did not become ready after restart: %s", svc.proc.name, e)

    def stop_all(self) -> None:
        self.stopping.set()
        for svc in reversed(self.services):
            code = svc.proc.stop()
            log.info("%s stopped (exit %s)", svc.proc.name, code)

    def banner(self) -> str:
        base = f"http://{self.cfg.host}:{self.cfg.gateway_port}"
        return "\n".join([
            "",
            f"ringserve is serving {self.cfg.model}",
            f"  HTTP gateway (OpenAI + SGLang native): {base}",
            f"  public gRPC API (tokenizer):           {self.cfg.host}:{self.cfg.tokenizer_port}",
            f"  metrics: {base}/metrics, http://{self.cfg.host}:{self.cfg.tokenizer_metrics_port}/metrics, "
            f"http://{self.cfg.host}:{self.cfg.scheduler_metrics_port}/metrics, "
            f"http://{self.cfg.host}:{self.cfg.detokenizer_metrics_port}/metrics",
            "try:",
            f"  curl {base}/generate -d '{{\"text\":\"你好\",\"sampling_params\":{{\"max_new_tokens\":8}}}}'",
            f"  curl {base}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\":\"{Path(self.cfg.model).name}\",\"prompt\":\"Hello\",\"max_tokens\":8}}'",
            "Ctrl-C stops everything.",
            "",
        ])


def tokenizer_grace_s(cfg: LauncherConfig) -> float:
    """The --detokenizer-grace-s the tokenizer will run with (its flag in --tokenizer-args, its env
    variable, else its default)."""
    from services.tokenizer.config import TokenizerConfig  # its config only, no gRPC or model

    args = shlex.split(cfg.tokenizer_args)
    for i, a in enumerate(args):
        if a.startswith("--detokenizer-grace-s="):
            return float(a.split("=", 1)[1])
        if a == "--detokenizer-grace-s" and i + 1 < len(args):
            return float(args[i + 1])
    raw = os.environ.get(env_name("detokenizer_grace_s"))
    if raw:
        return float(raw)
    default = next(f.default for f in fields(TokenizerConfig) if f.name == "detokenizer_grace_s")
    return float(default)  # type: ignore[arg-type]


def check_restart_policy(cfg: LauncherConfig) -> None:
    """The tokenizer keeps requests alive while the detokenizer is away for its grace period; a
    restart that waits as long as that grace turns every detokenizer crash into failed requests.
    Warn (one line) when the longest backoff plus a start does not fit in the grace."""
    grace = tokenizer_grace_s(cfg)
    if grace <= cfg.max_backoff_s + DETOKENIZER_START_S:
        log.warning("tokenizer --detokenizer-grace-s %.0fs is not longer than --max-backoff-s %.0fs plus a "
                    "detokenizer start (~%.0fs): in-flight requests fail when the detokenizer crashes "
                    "repeatedly", grace, cfg.max_backoff_s, DETOKENIZER_START_S)


def preflight(cfg: LauncherConfig) -> LauncherConfig:
    """The model every service will read, prepared (fetched, converted) and checked before any starts;
    a model that cannot be served exits here with one line."""
    from services.scheduler.models import check_architectures  # a torch-free table

    with exit_on_model_error():
        path = resolve_model(cfg.model, prepare=True)
        if cfg.tokenizer_path:
            path = with_tokenizer(path, cfg.tokenizer_path, prepare=True)
        require_files(path, cfg.model, "config.json", "tokenizer.json")
        check_architectures(architectures(path), cfg.model)
    return replace(cfg, model=str(path))


def main(argv: list[str] | None = None) -> int:
    setup_logging("launcher")
    cfg = preflight(parse_config(LauncherConfig, argv))
    check_restart_policy(cfg)
    launcher = Launcher(cfg)
    done = threading.Event()
    started = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        done.set()
        if not started.is_set():
            raise KeyboardInterrupt  # interrupt a startup wait (model load can take minutes)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        launcher.start_all()
    except (TimeoutError, RuntimeError, KeyboardInterrupt) as e:
        log.error("startup stopped: %s", e or "interrupted")
        launcher.stop_all()
        return 1
    started.set()
    print(launcher.banner(), flush=True)
    done.wait()
    launcher.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
