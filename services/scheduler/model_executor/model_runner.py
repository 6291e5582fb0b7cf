"""Loads the model, sizes and owns the KV pools, and runs forward passes (eager or CUDA graph)."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.scheduler import memory
from services.scheduler.attention.backend import TorchSDPABackend
from services.scheduler.attention.decode_cache import default_budget, shared_budget
from services.scheduler.kernels import cpu_linear
from services.scheduler.kernels.cpu_kernels import KV_DTYPES as NATIVE_KV_DTYPES
from services.scheduler.kernels.cpu_kernels import load as load_cpu_kernels
from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.lora.manager import LoraManager, LoraSettings
from services.scheduler.model_executor import cpu_decode, model_loader
from services.scheduler.model_executor.cpu_decode import NativeDecodeStack
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.models import check_architectures, get_model_class
from services.scheduler.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
# KV-only dtypes (SGLang's names): fp8 without a scale, on the CPU C kernels.
_KV_ONLY_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CPU_KV_CAP_BYTES = 1 << 30   # CPU default: at most 1 GiB of KV ...
CPU_KV_RAM_FRACTION = 0.15   # ... and at most this share of available RAM (the machine is shared)


class ModelRunner:
    def __init__(self, model_path: str, *, device: str | None = None, dtype: str = "auto",
                 kv_cache_dtype: str = "auto", max_total_tokens: int | None = None, mem_fraction: float = 0.85,
                 max_running_requests: int = 256, context_length: int | None = None,
                 cuda_graph_max_bs: int = 64, disable_cuda_graph: bool = False,
                 num_threads: int | None = None, decode_threads: int | None = None, cpu_kernels: bool = True,
                 kernel_cache: str | None = None, decode_cache_bytes: int | None = None,
                 attention_backend: str | None = None, emulate_cuda_graph: bool = False,
                 other_bounds: Sequence[memory.Bound] = (), synthetic_forward: bool = False,
                 lora: LoraSettings | None = None) -> None:
        """kv_cache_dtype: the KV cache's dtype (auto: bfloat16 where the CPU runs bf16 linears, else the
        activations'); other_bounds: host memory the caller will allocate besides the
        runner's (the grammar cache), for the startup memory check. attention_backend: triton,
        flashinfer or torch (None: triton on CUDA when it imports, else torch). emulate_cuda_graph:
        run the CUDA-graph logic on any device with recorded functions in place of graphs (tests).
        synthetic_forward: `forward` skips the model and returns logits that pick `synthetic_tokens`
        (benchmarks of the services around the scheduler; the pools and the scheduling are real).
        lora: serve LoRA adapters (the slot pool is reserved now; None: no LoRA, and nothing of it
        in the forward)."""
        t0 = time.monotonic()
        self.model_path = model_path
        self.synthetic_forward = synthetic_forward
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        path = model_loader.resolve_model_path(model_path)
        self.model_config = model_loader.load_config(path)
        # The dtype asked for, and where it applies. On CPU with the C kernels, bfloat16 is the linears'
        # (weights held and GEMMs run in bf16, where most of a step's time goes) and the KV cache's
        # (attention reads it widened to float32); activations, norms and softmax stay float32.
        self.linear_dtype = _resolve_dtype(dtype, self.device, self.model_config)
        self.dtype = (torch.float32 if self.device.type == "cpu" and self.linear_dtype == torch.bfloat16
                      and cpu_kernels and cpu_linear.supported(torch.bfloat16) else self.linear_dtype)
        if self.device.type == "cpu" and self.linear_dtype == torch.bfloat16 and not cpu_linear.native_bf16():
            logger.warning("dtype bfloat16 on a CPU without AVX512-BF16 or AMX: its GEMMs are emulated, "
                           "slower than float32")
        elif self.device.type == "cpu" and dtype == "auto" and self.dtype == torch.float32 and cpu_linear.native_bf16():
            logger.info("dtype auto: float32, the checkpoint's; this CPU computes bfloat16 natively, so "
                        "--dtype bfloat16 would run the linears about twice as fast (greedy output then "
                        "differs from float32 at near-ties)")
        if num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(num_threads)
        elif synthetic_forward and self.device.type == "cpu":
            # No model runs: the steps' only parallel regions are the synthetic logits and their
            # sampling, after which a second OpenMP thread spins for milliseconds on the core the
            # services driven by the benchmark need (bench-ring: 5.2-5.4k -> 8.3-9.4k tok/s carried).
            torch.set_num_threads(1)
        # Prefill is GEMM-bound and gains from every core; a decode step is short, and its threads'
        # barriers stall whenever another process (the services, on a shared machine) takes a core.
        self.prefill_threads = torch.get_num_threads()
        self.decode_threads = min(decode_threads or self.prefill_threads, self.prefill_threads)
        self._threads = self.prefill_threads
        if self.device.type == "cpu":
            logger.info("CPU threads: %d for prefill, %d for decode", self.prefill_threads, self.decode_threads)
        self.cpu_kernels = cpu_kernels
        self.kernel_cache = kernel_cache
        # The C kernels (attention with the decode K/V store, rotary, SiLU gate, norms, argmax) for float32 on CPU;
        # None: torch everywhere.
        self.native = (load_cpu_kernels(kernel_cache)
                       if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels else None)
        self.argmax = self.native.argmax if self.native is not None else None  # greedy sampling's
        self.kv_dtype = _resolve_kv_dtype(kv_cache_dtype, self.dtype, self.linear_dtype, self.native is not None)

        self.eos_token_ids = model_loader.load_eos_token_ids(path, self.model_config)
        cfg = self.model_config
        self.vocab_size = cfg.vocab_size
        self.context_length = context_length or cfg.max_position_embeddings
        logger.info("model config: %s, %d layers, hidden %d, vocab %d, context %d, %s on %s",
                    cfg.architectures, cfg.num_hidden_layers, cfg.hidden_size, self.vocab_size,
                    self.context_length, self.dtype_label(), self.device)

        self.model = self._load_model(path)
        if lora is None and self.linear_dtype == torch.bfloat16 and self.native is not None:
            # LoRA's hooks read the linears' float32 input and add into their float32 output.
            logger.info("bf16 linears: %d hand their output to the C kernels unwidened",
                        self.model.use_bf16_edges())
        self.weights_bytes = _weights_bytes(self.model)
        logger.info("weights loaded in %.1fs", time.monotonic() - t0)
        # After packing: the wrappers call whatever linear the CPU path left in place.
        self.lora = LoraManager(self.model, lora, self.device, self.dtype) if lora is not None else None

        attn = self.model.first_attention()
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.max_total_num_tokens = self._kv_budget(max_total_tokens, mem_fraction, max_running_requests)
        self.decode_cache_bytes = decode_cache_bytes
        self._check_memory(max_running_requests, list(other_bounds))
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, self.context_length + 4, self.device)
        self.token_to_kv_pool = TokenToKVPool(self.max_total_num_tokens, cfg.num_hidden_layers,
                                              self.num_kv_heads, self.head_dim, self.kv_dtype, self.device)
        logger.info("KV pool: %d tokens (%.1f MiB), %d request rows", self.max_total_num_tokens,
                    self.max_total_num_tokens * self.token_to_kv_pool.bytes_per_token / 2**20,
                    max_running_requests + 1)
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self._backend_requested = attention_backend is not None
        self.attn_backend = self._make_attn_backend()

        self.cuda_graph_runner = None
        if (self.device.type == "cuda" or emulate_cuda_graph) and not disable_cuda_graph and cuda_graph_max_bs > 0:
            from services.scheduler.model_executor.cuda_graph import CudaGraphRunner

            t1 = time.monotonic()
            self.cuda_graph_runner = CudaGraphRunner(self, cuda_graph_max_bs, emulate=emulate_cuda_graph)
            logger.info("CUDA graphs: captured bs up to %d in %.1fs", cuda_graph_max_bs, time.monotonic() - t1)
        # CPU: a decode step of a Llama stack in one native call (where every piece of it has one).
        self.decode_stack: NativeDecodeStack | None = None
        if self.device.type == "cpu" and not disable_cuda_graph and self.lora is None:
            why = cpu_decode.unsupported(self.model, self.attn_backend, self.native)
            if why is None and self.native is not None:
                self.decode_stack = NativeDecodeStack(self.model, self.attn_backend, self.native)
                logger.info("decode: the whole stack in one native call (from %d rows with the linears called "
                            "back in torch)", cpu_linear.TILES_MAX_T + 1 if self.decode_stack.tiled
                            else cpu_linear.BF16_SMALL_T)
            else:
                logger.info("decode in one native call: off (%s)", why)
        if synthetic_forward:
            logger.warning("synthetic forward: the model is not run; every step emits fixed pseudo-random tokens "
                           "(for benchmarks of the services, never for serving)")
        logger.info("model runner ready in %.1fs", time.monotonic() - t0)

    def dtype_label(self) -> str:
        """The dtypes as served: "bfloat16" or "float32" when linears, activations and KV cache share
        one, else what holds which, e.g. "bfloat16 linears and KV, float32 activations" (CPU)."""
        parts = {"linears": self.linear_dtype, "activations": self.dtype, "KV": self.kv_dtype}
        if len(set(parts.values())) == 1:
            return _name(self.dtype)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for part, dtype in parts.items():
            by_dtype.setdefault(dtype, []).append(part)
        return ", ".join(f"{kv_cache_dtype_name(d)} {' and '.join(names)}" for d, names in by_dtype.items())

    # ---- setup ----

    def _load_model(self, path) -> LlamaForCausalLM:
        cls = get_model_class(self.model_config)
        self.architecture = check_architectures(list(self.model_config.architectures or []), self.model_path)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):  # no random init: every parameter is overwritten by the checkpoint
                model = cls(self.model_config, max_position=self.context_length)
        finally:
            torch.set_default_dtype(prev)
        model = model.to_empty(device=self.device)
        model.load_weights(model_loader.iter_weights(path))
        model.init_rotary(self.device, self.dtype)
        if self.native is not None:
            model.use_native_kernels(self.native)
        if self.device.type == "cpu" and self.dtype == torch.float32 and self.cpu_kernels and cpu_linear.supported():
            if model.lm_head is None:  # tied: a packed copy of the embedding matrix for the logits
                model.lm_head = cpu_linear.PackedLinear(model.embed_tokens.weight, None, self.linear_dtype, tied=True,
                                                        native=self.native)
            logger.info("linear layers: %d on oneDNN with packed %s weights",
                        cpu_linear.pack_linears(model, self.linear_dtype, self.native), _name(self.linear_dtype))
        return model.eval()

    def _make_attn_backend(self) -> Any:
        # The model's softmax scale (Gemma 3: query_pre_attn_scalar) and per-layer sliding windows. A
        # backend serves windows when its class says so (`supports_sliding_window`, taking
        # `sliding_windows=` as TorchSDPABackend does); a windowed model never runs on one that would
        # ignore them: asked for by name, that is an error, by default torch SDPA serves instead.
        scaling, windows = self.model.first_attention().scaling, self.model.sliding_windows()
        name = self.attention_backend
        if name == "triton":
            from services.scheduler.attention.triton_backend import TritonAttnBackend

            if self._window_capable(TritonAttnBackend, name, windows):
                logger.info("attention backend: triton (paged, split-K decode)")
                # 16 splits fill an H200's SMs at small batches; on CPU (the interpreter, in tests) fewer
                # programs keep it fast.
                return TritonAttnBackend(self.req_to_token_pool, self.token_to_kv_pool,
                                         self.num_heads, self.num_kv_heads, self.head_dim, scaling=scaling,
                                         num_splits=16 if self.device.type == "cuda" else 2,
                                         **_window_kwargs(windows))
        if name == "flashinfer":
            from services.scheduler.attention.flashinfer_backend import FlashInferAttnBackend

            if self._window_capable(FlashInferAttnBackend, name, windows):
                logger.info("attention backend: flashinfer")
                return FlashInferAttnBackend(self.req_to_token_pool, self.token_to_kv_pool,
                                             self.num_heads, self.num_kv_heads, self.head_dim, scaling=scaling,
                                             **_window_kwargs(windows))
        self.attention_backend = "torch"
        logger.info("attention backend: torch SDPA%s", ", decode and prefill on the C kernels" if self.native else "")
        return TorchSDPABackend(self.req_to_token_pool, self.token_to_kv_pool,
                                self.num_heads, self.num_kv_heads, self.head_dim,
                                scaling=self.model.first_attention().scaling, native=self.native, dtype=self.dtype,
                                decode_cache_bytes=self.decode_cache_bytes,
                                sliding_windows=self.model.sliding_windows(), prefill_dtype=self.linear_dtype)

    def _window_capable(self, cls: type, name: str, windows: list[int | None]) -> bool:
        """Whether backend `cls` can serve this model's windows (always, when it has none)."""
        if all(w is None for w in windows) or getattr(cls, "supports_sliding_window", False):
            return True
        sizes = sorted({w for w in windows if w is not None})
        if self._backend_requested:
            raise ValueError(f"attention_backend: {name} has no sliding-window attention, which this model's "
                             f"layers use (windows {sizes}); use --attention-backend torch")
        logger.warning("attention backend: %s has no sliding-window attention, which this model's layers use "
                       "(windows %s): torch SDPA instead", name, sizes)
        return False

    def _check_memory(self, max_running: int, other_bounds: list[memory.Bound]) -> None:
        """Before the pools exist: do their bounds (and the decode caches', on CPU) fit? Raises
        memory.MemoryBudgetError naming the setting to lower (memory.py)."""
        kv = self.max_total_num_tokens * self._kv_bytes_per_token()
        rows = (max_running + 1) * (self.context_length + 4) * 8
        device = [memory.Bound(kv, "KV pool", "--max-total-tokens"),
                  memory.Bound(rows, "request rows", "--max-running-requests")]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            memory.check_fits(device, (free, f"free memory on {self.device}"), headroom=0)
            memory.check_fits(other_bounds, memory.room_bytes())
            return
        if self.decode_cache_bytes is None:  # twice the pool by default: the pool's setting sizes it
            decode = default_budget(kv)
            cache = memory.Bound(decode + shared_budget(decode), "decode caches",
                                 "--max-total-tokens or set --decode-cache-mib")
        else:
            decode = self.decode_cache_bytes
            cache = memory.Bound(decode + shared_budget(decode), "decode caches", "--decode-cache-mib")
        memory.check_fits([*device, cache, *other_bounds], memory.room_bytes())

    def _kv_bytes_per_token(self) -> int:
        return 2 * self.model_config.num_hidden_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def memory_items(self) -> list[memory.MemoryItem]:
        """What the runner holds now and each holder's bound (memory.py's table)."""
        kv, rows = self.token_to_kv_pool, self.req_to_token_pool
        kv_bytes = sum(t.nbytes for t in (*kv.k_buffer, *kv.v_buffer))
        items = [memory.MemoryItem("weights", self.weights_bytes, self.weights_bytes, "--model, --dtype"),
                 memory.MemoryItem("kv_pool", kv_bytes, kv_bytes, "--max-total-tokens, --kv-cache-dtype"),
                 memory.MemoryItem("req_to_token", rows.req_to_token.nbytes, rows.req_to_token.nbytes,
                                   "--max-running-requests")]
        dense = self.attn_backend.dense
        if dense is not None:
            items.append(memory.MemoryItem("decode_rows", dense.held_bytes(), dense.max_bytes, "--decode-cache-mib"))
            shared = dense.shared
            if shared is not None:
                items.append(memory.MemoryItem("shared_prefixes", shared.held_bytes(), shared.max_bytes,
                                               "--decode-cache-mib / 4"))
        if self.lora is not None:
            pool = self.lora.pool_bytes
            items.append(memory.MemoryItem("lora_slots", pool, pool, "--max-loras-per-batch, --max-lora-rank"))
            items.append(memory.MemoryItem("lora_adapters", self.lora.host_bytes, self.lora.host_bytes,
                                           "--max-loaded-loras"))
        if self.device.type == "cuda":
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            items.append(memory.MemoryItem("cuda_cached", cached, cached, "returned when idle"))
        return items

    def release_idle(self) -> None:
        """With nothing running: drop the buffers grown for the load (decode caches) and hand the
        allocators' free memory back to the OS."""
        if self.attn_backend.dense is not None:
            self.attn_backend.dense.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        memory.malloc_trim()

    def _kv_budget(self, max_total_tokens: int | None, mem_fraction: float, max_running: int) -> int:
        if max_total_tokens is not None:
            return int(max_total_tokens)
        per_token = self._kv_bytes_per_token()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * mem_fraction
        else:
            budget = min(CPU_KV_CAP_BYTES, CPU_KV_RAM_FRACTION * _available_ram_bytes())
        tokens = int(budget // per_token)
        # More than every running request at full context is never used.
        tokens = min(tokens, max_running * self.context_length)
        if tokens < self.context_length:
            logger.warning("KV budget (%d tokens) is below the context length %d", tokens, self.context_length)
        return max(tokens, 16)

    # ---- forward ----

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 of each request's last new token (with batch.logit_rows: of each
        request's last logit_rows[b] new tokens, [sum(logit_rows), V]; with batch.greedy maybe their
        argmax ids instead, [B] int64)."""
        if self.synthetic_forward:
            return self.synthetic_outputs(batch)
        if batch.lora_ids is not None and self.lora is not None:
            # Eager: the captured graphs hold the base model only (the LoRA plan changes every batch).
            self.lora.begin(batch.lora_ids, batch.extend_lens)
            try:
                return self.forward_eager(batch)
            finally:
                self.lora.end()
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch):
            return self.cuda_graph_runner.replay(batch)
        return self.forward_eager(batch)

    def synthetic_outputs(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] float32 (R as `forward`) that put all the mass on `synthetic_tokens` of each
        logit row: greedy and sampled requests alike get those tokens, so a run is repeatable. A greedy
        decode batch (batch.greedy) gets the [B] int64 tokens themselves, as the model's fused argmax
        gives them: building and scanning [B, V] logits (12.6 MB at 64 x 49,152) each step would be
        the step's largest cost, in the CPU and memory the benchmarked services share."""
        if batch.mode == ForwardMode.DECODE:
            ids, pos = batch.input_ids, batch.positions  # [B]
            if batch.greedy:
                return synthetic_tokens(ids, pos, self.vocab_size, self.eos_token_ids)
        else:
            index = _logit_index(batch.extend_lens, batch.logit_rows, self.device)
            ids = batch.input_ids if index is None else batch.input_ids.index_select(0, index)  # [R]
            pos = batch.positions if index is None else batch.positions.index_select(0, index)
        logits = torch.full((ids.shape[0], self.vocab_size), -1e4, dtype=torch.float32, device=self.device)
        logits.scatter_(1, synthetic_tokens(ids, pos, self.vocab_size, self.eos_token_ids).unsqueeze(1), 0.0)
        return logits

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        if self.device.type == "cpu":
            self._use_threads(self.decode_threads if batch.mode == ForwardMode.DECODE else self.prefill_threads)
        self.attn_backend.init_forward_metadata(batch)
        if self.decode_stack is not None and self.decode_stack.can_run(batch):
            return self.decode_stack.run(batch)
        if batch.mode == ForwardMode.DECODE:
            last_index = None  # one token per request: every row is a last token
        else:
            last_index = _logit_index(batch.extend_lens, batch.logit_rows, self.device)
        return self.model(batch.input_ids, batch.positions, self.attn_backend, last_index)

    def _use_threads(self, n: int) -> None:
        # Set on the calling (engine) thread every time it changes: OpenMP's thread count is per thread.
        if n != self._threads or torch.get_num_threads() != n:
            torch.set_num_threads(n)
            self._threads = n

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny prefill and decode through the pools (then freed), so the first request pays no setup."""
        row = self.req_to_token_pool.alloc()
        slots = self.token_to_kv_pool.alloc(2)
        assert row is not None and slots is not None  # the pools are empty at warmup
        try:
            self.req_to_token_pool.req_to_token[row, :2] = slots
            ids = torch.tensor([0, 0], dtype=torch.int64, device=self.device)
            rows = torch.tensor([row], dtype=torch.int64, device=self.device)
            self.forward(ForwardBatch(
                ForwardMode.EXTEND, ids[:1], torch.zeros(1, dtype=torch.int64, device=self.device), slots[:1],
                rows, torch.tensor([1], device=self.device), [1], [0], [1]))
            self.forward(ForwardBatch(
                ForwardMode.DECODE, ids[1:], torch.ones(1, dtype=torch.int64, device=self.device), slots[1:],
                rows, torch.tensor([2], device=self.device), [1], [1], [2]))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.token_to_kv_pool.free(slots)
            self.req_to_token_pool.free(row)


# Synthetic tokens avoid the low ids, where tokenizers keep their special and byte tokens.
SYNTHETIC_LOW_ID = 256


def synthetic_tokens(ids: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """[R] int64 next tokens as a fixed function of (last token, its position): ordinary vocabulary
    (never EOS, never the low ids), different from step to step, the same on every run."""
    low = min(SYNTHETIC_LOW_ID, vocab_size // 2)
    span = vocab_size - low
    mixed = (ids * 7919 + positions * 104729) % 2147483647
    out = (mixed * 48271) % 2147483647 % span + low  # [R]; one Lehmer (MINSTD) step spreads it out
    for eos in eos_token_ids:
        out = torch.where(out == eos, low + (out + 1 - low) % span, out)
    return out


def _logit_index(extend_lens: list[int], logit_rows: list[int] | None, device: torch.device) -> torch.Tensor | None:
    """[R] int64 rows of the packed tokens whose logits are wanted; None when that is every row."""
    rows = logit_rows or [1] * len(extend_lens)
    index: list[int] = []
    end = 0
    for n, k in zip(extend_lens, rows):
        end += n
        index.extend(range(end - k, end))
    return None if len(index) == end else torch.tensor(index, dtype=torch.int64).to(device)


def _weights_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers (rotary tables), plus the oneDNN-packed and tile-layout copies of the linear
    weights."""
    seen: set[int] = set()
    total = 0
    linears = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    for t in (*model.parameters(), *model.buffers(), *(m.packed for m in linears),
              *(m.tiled for m in linears if m.tiled is not None)):
        if id(t) not in seen:  # tied weights count once
            seen.add(id(t))
            total += t.nbytes
    return total


ATTENTION_BACKENDS = ("triton", "flashinfer", "torch")


def _window_kwargs(windows: list[int | None]) -> dict[str, Any]:
    """`sliding_windows=` for a backend only when a layer has one: backends without windows take none."""
    return {"sliding_windows": windows} if any(w is not None for w in windows) else {}


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    """The backend a runner on `device` uses for --attention-backend `name` (None: the default).
    Raises ValueError naming the flag when the choice cannot run here."""
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name is None:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend: triton is not installed (pip install triton)")
        # On CPU the kernels run only in Triton's interpreter: far too slow to serve, but how the tests
        # run the backend end to end without a GPU.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend: triton needs a CUDA device (on CPU only under TRITON_INTERPRET=1)")
    if name == "flashinfer":
        from services.scheduler.attention.flashinfer_backend import available

        why = available() if device.type == "cuda" else "needs a CUDA device"
        if why is not None:
            raise ValueError(f"attention_backend: flashinfer {why}")
    return name


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """A KV dtype as --kv-cache-dtype names it (fp8: SGLang's names, fp8_e4m3 / fp8_e5m2)."""
    return next((name for name, d in _KV_ONLY_DTYPES.items() if d == dtype), _name(dtype))


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: Any = None) -> torch.dtype:
    """--dtype as a torch dtype. auto: bfloat16 on CUDA; on CPU the checkpoint's own dtype, as vLLM
    does: float32 checkpoints (and those that say none) in float32, half-precision ones in bfloat16
    where the CPU computes it natively (AVX512-BF16 or AMX) and in float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        half = str(saved).removeprefix("torch.") in ("bfloat16", "float16")
        return torch.bfloat16 if half and cpu_linear.native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, linear_dtype: torch.dtype,
                      native: bool) -> torch.dtype:
    """--kv-cache-dtype as a torch dtype, given the activations' dtype and the linears'. auto: the
    activations' dtype, except bfloat16 where the CPU's C kernels run bf16 linears (half the bytes
    for attention to read, which waits on memory; both are bf16 roundings of float32 values). A
    dtype other than the activations' needs those kernels (the only ones that widen as they read)."""
    if kv_cache_dtype == "auto":
        return torch.bfloat16 if native and linear_dtype == torch.bfloat16 else dtype
    names = {**_DTYPES, **_KV_ONLY_DTYPES}
    if kv_cache_dtype not in names:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; one of auto, {', '.join(names)}")
    kv = names[kv_cache_dtype]
    if native and kv not in NATIVE_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: the CPU C kernels hold the KV cache in "
                         f"{' or '.join(map(_name, NATIVE_KV_DTYPES))}")
    if kv != dtype and not native:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} with {_name(dtype)} activations needs the CPU C "
                         f"kernels (CPU, a C compiler, no --disable-cpu-kernels); here it must be auto or "
                         f"{_name(dtype)}")
    return kv


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
