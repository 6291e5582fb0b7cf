"""Scheduler configuration: engine settings, then the service around them (flags / RINGSERVE_* env)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields

from ringserve.text_tokenizer import default_model
from ringserve.tls import TlsConfig


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """What the in-process Engine needs (tests and benchmarks build this directly)."""

    model: str = field(default_factory=default_model, metadata=_h("model directory or hub id"))
    device: str | None = field(default=None, metadata=_h("cpu, cuda or cuda:N (default: cuda if present)"))
    dtype: str = field(default="auto", metadata=_h(
        "float32, bfloat16 or float16. auto: bfloat16 on CUDA; on CPU the checkpoint's (a half-precision one in "
        "bfloat16 where the CPU has AVX512-BF16 or AMX, else float32). bfloat16 on CPU: bf16 linear weights and "
        "GEMMs and bf16 KV cache (--kv-cache-dtype), float32 activations"))
    kv_cache_dtype: str = field(default="auto", metadata=_h(
        "the KV cache's dtype: auto, float32, bfloat16, fp8_e4m3 or fp8_e5m2. auto: the activations' dtype, but "
        "bfloat16 on CPU with bf16 linears (--dtype bfloat16). bfloat16 on CPU float32 halves what attention "
        "reads (the C kernels widen it as they read; greedy output then differs from float32 at near-ties); "
        "fp8 (CPU C kernels, no scale: values saturate at 448 / 57344) halves it again"))
    max_total_tokens: int | None = field(default=None, metadata=_h("KV pool size in tokens (default: from memory)"))
    mem_fraction: float = field(default=0.85, metadata=_h("share of free GPU memory for the KV pool"))
    max_running_requests: int = field(default=256, metadata=_h("most requests in the running batch"))
    max_prefill_tokens: int = field(default=16384, metadata=_h("most prompt tokens in one prefill batch"))
    chunked_prefill_size: int | None = field(default=None, metadata=_h(
        "prefill chunk size; 0 disables chunking (default: 2048 on CPU, 8192 on CUDA)"))
    enable_mixed_chunk: bool = field(default=False, metadata=_h(
        "run the running requests' decode step inside each prefill step instead of stalling them"))
    disable_decode_interleave: bool = field(default=False, metadata=_h(
        "run waiting prefills back to back while the running requests wait (SGLang's order); by default "
        "a decode step for the running requests follows every prefill step"))
    schedule_policy: str = field(default="fcfs", metadata=_h("fcfs or lpm (longest prefix match first)"))
    schedule_conservativeness: float = field(default=1.0, metadata=_h(
        "scales the estimate of how much of max_new_tokens running requests will use: below 1 admits more "
        "requests at once (and retracts more often when they outgrow the KV pool), above 1 fewer"))
    max_queued_requests: int = field(default=4096, metadata=_h("most waiting requests before intake refuses"))
    context_length: int | None = field(default=None, metadata=_h("override the model's context length"))
    disable_cuda_graph: bool = field(default=False, metadata=_h(
        "run decode eagerly: no CUDA graphs on CUDA; on CPU, no one-call native decode stack"))
    cuda_graph_max_bs: int = field(default=64, metadata=_h("largest decode batch captured in a CUDA graph"))
    attention_backend: str | None = field(default=None, metadata=_h(
        "triton, flashinfer or torch (default: triton on CUDA, torch SDPA + the C kernels on CPU); "
        "flashinfer needs `pip install flashinfer-python` and a GPU"))
    disable_radix_cache: bool = field(default=False, metadata=_h("turn off prefix caching"))
    disable_overlap_schedule: bool | None = field(default=None, metadata=_h(
        "run each step's forward on the scheduler's thread instead of overlapping it with the scheduling "
        "of the next step and the processing of the previous one's tokens. Default: overlap on CUDA, "
        "not on CPU (on 2 idle cores the scheduler's Python slows the forward's threads); "
        "--no-disable-overlap-schedule turns it on there"))
    num_threads: int | None = field(default=None, metadata=_h("torch CPU threads (default: torch's choice)"))
    decode_threads: int | None = field(default=None, metadata=_h(
        "CPU threads for decode steps (default: num_threads); prefill keeps num_threads. Fewer than the "
        "cores leaves a core to processes sharing the machine (the launcher sets it)"))
    disable_cpu_kernels: bool = field(default=False, metadata=_h("plain torch on CPU: no C attention "
                                                                  "kernels, no oneDNN-packed linear weights"))
    kernel_cache: str | None = field(default=None, metadata=_h("directory for the compiled CPU kernels "
                                                                "(default ~/.cache/ringserve/kernels)"))
    stream_interval: int = field(default=1, metadata=_h("send a streaming request's new tokens every N tokens "
                                                         "(its first token and its finish go out at once); "
                                                         "larger is less smooth but cheaper per token"))
    grammar_backend: str = field(default="xgrammar", metadata=_h("constrained decoding backend: xgrammar or "
                                                                  "none (constrained requests are refused)"))
    grammar_compile_timeout_s: float = field(default=30.0, metadata=_h("abort a request whose grammar takes "
                                                                        "longer than this to compile"))
    grammar_cache_size: int = field(default=256, metadata=_h("compiled grammars kept (LRU)"))
    grammar_cache_mib: int = field(default=64, metadata=_h("MiB of compiled grammars kept (LRU, with "
                                                            "--grammar-cache-size)"))
    decode_cache_mib: int | None = field(default=None, metadata=_h(
        "CPU decode: MiB for the dense per-request K/V copies (a quarter more for shared prefixes); "
        "beyond it decode gathers from the pool (slower). Default: twice the KV pool, at least 1024"))
    lora_paths: tuple[str, ...] = field(default=(), metadata=_h(
        "LoRA adapters (PEFT directories) to load at startup, each NAME=PATH (or PATH, named PATH)"))
    enable_lora: bool = field(default=False, metadata=_h(
        "serve LoRA adapters loaded at run time (LoadLoraAdapter); implied by --lora-paths"))
    max_loras_per_batch: int = field(default=8, metadata=_h(
        "most distinct LoRA adapters in one batch: the adapter slots reserved at startup"))
    max_lora_rank: int | None = field(default=None, metadata=_h(
        "highest LoRA rank the slots hold (default: the largest of --lora-paths, else 16)"))
    lora_target_modules: tuple[str, ...] = field(default=("all",), metadata=_h(
        "projections adapters may target, reserved in every slot: all, or of q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj (qkv_proj, gate_up_proj)"))
    max_loaded_loras: int = field(default=64, metadata=_h("most LoRA adapters loaded at once (host memory)"))

    synthetic_forward: bool = field(default=False, metadata=_h(
        "benchmarking only: skip the model's forward and emit fixed pseudo-random tokens (never EOS), so "
        "the gateway, tokenizer and detokenizer can be driven at their limit (bench/ring_cpu.py)"))

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy: {self.schedule_policy!r} is not fcfs or lpm")
        for name in ("max_running_requests", "max_prefill_tokens", "max_queued_requests", "stream_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if not self.schedule_conservativeness > 0:
            raise ValueError("schedule_conservativeness: must be > 0")
        for name in ("num_threads", "decode_threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ValueError("chunked_prefill_size: must be >= 0")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("max_total_tokens: must be >= 2")
        if self.attention_backend is not None and self.attention_backend not in ("triton", "flashinfer", "torch"):
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not triton, flashinfer or torch")
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(f"grammar_backend: {self.grammar_backend!r} is not xgrammar or none")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s: must be > 0")
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size: must be >= 1")
        if self.grammar_cache_mib < 1:
            raise ValueError("grammar_cache_mib: must be >= 1")
        if self.decode_cache_mib is not None and self.decode_cache_mib < 0:
            raise ValueError("decode_cache_mib: must be >= 0")
        for name in ("max_loras_per_batch", "max_loaded_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: must be >= 1")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)


@dataclass(frozen=True)
class SchedulerServerConfig(EngineConfig, TlsConfig):
    """The SchedulerService process: `python -m services.scheduler`."""

    host: str = field(default="127.0.0.1", metadata=_h("gRPC bind address"))
    port: int = field(default=50052, metadata=_h("gRPC port"))
    metrics_port: int = field(default=9092, metadata=_h("Prometheus /metrics port; -1 disables"))
    detokenizer: str = field(default="127.0.0.1:50053", metadata=_h(
        "detokenizer HOST:PORT to push to; empty: none (a scheduler driven only through "
        "--sglang-grpc-port, whose client detokenizes, is SERVING without one)"))
    sglang_grpc_port: int | None = field(default=None, metadata=_h(
        "also serve SGLang's scheduler protocol (sglang.grpc.scheduler.SglangScheduler, what SGLang's "
        "gateway smg drives; SGLang's own --grpc-mode) on this port; unset: off"))
    scheduler_id: str = field(default="", metadata=_h("id sent to the detokenizer (default: host-pid)"))
    grace_period_s: float = field(default=30.0, metadata=_h("on SIGTERM, time given to running requests"))
    load_report_interval_s: float = field(default=0.5, metadata=_h("LoadReport period on Connect streams"))

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        TlsConfig.__post_init__(self)
        if self.sglang_grpc_port is not None and not 0 <= self.sglang_grpc_port <= 65535:
            raise ValueError(f"sglang_grpc_port: {self.sglang_grpc_port} is not a port")
        if not self.detokenizer and self.sglang_grpc_port is None:
            raise ValueError("detokenizer: empty only with --sglang-grpc-port (outputs must go somewhere)")

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    @property
    def id(self) -> str:
        return self.scheduler_id or f"scheduler-{socket.gethostname()}-{os.getpid()}"
