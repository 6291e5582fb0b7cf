"""The scheduler's adapters: loaded by name (host memory), and the slot pool the forward reads.

Rules:
- The pool (`--max-loras-per-batch` slots of rank `--max-lora-rank` for every targeted projection of
  every layer) is allocated once at startup; loading an adapter never allocates device memory.
- A batch uses at most `max_loras_per_batch` distinct adapters (the prefill admits no request that
  would exceed it: prefill.py), so each forward's adapters all fit in slots. Slots are filled on
  demand from the host copies; the least recently used unpinned slot not in this batch is reused.
- Each load gets a new `uid` (never reused), so a name unloaded and loaded again with other weights
  never matches KV computed with the old ones (the radix cache keys by uid).
- Loading and unloading run on gRPC worker threads; anything that touches the pool or what the engine
  reads runs under the engine's step lock (core/control.py takes it). The host copy is read first,
  outside the lock, so a slow disk does not stall the steps.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ringserve.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from services.scheduler.lora.adapter import (
    FUSED_SLICES,
    HF_TARGETS,
    AdapterError,
    LoraWeights,
    expand_targets,
    load_adapter,
    parse_lora_paths,
    peek_rank,
)
from services.scheduler.lora.layers import LoraProjection, LoraState, plan_rows

if TYPE_CHECKING:
    from services.scheduler.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
DEFAULT_MAX_LOADED = 64


@dataclass(frozen=True)
class LoraSettings:
    max_loras_per_batch: int = 8
    max_lora_rank: int = 16
    target_modules: tuple[str, ...] = ("all",)
    max_loaded_loras: int = DEFAULT_MAX_LOADED  # host copies held at once (each costs its size in RAM)


def settings_for(enabled: bool, lora_paths: tuple[str, ...], max_loras_per_batch: int, max_lora_rank: int | None,
                 target_modules: tuple[str, ...], max_loaded_loras: int) -> LoraSettings | None:
    """The engine's flags -> LoraSettings (None: LoRA off). The rank defaults to the largest of the
    startup adapters' (their configs are read here), else 16."""
    if not enabled:
        return None
    startup = parse_lora_paths(lora_paths)
    if max_lora_rank is None:
        try:
            max_lora_rank = max([peek_rank(p, n) for n, p in startup], default=16)
        except AdapterError as e:
            raise ValueError(f"--lora-paths: {e}") from None
    expand_targets(target_modules)  # a bad name fails at startup
    return LoraSettings(max_loras_per_batch, max_lora_rank, tuple(target_modules), max_loaded_loras)


class LoadedAdapter(NamedTuple):
    uid: int
    weights: LoraWeights
    pinned: bool


class LoraManager:
    def __init__(self, model: LlamaForCausalLM, settings: LoraSettings, device: torch.device,
                 dtype: torch.dtype) -> None:
        if settings.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be at least 1")
        if settings.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        self.settings = settings
        self.allowed = expand_targets(settings.target_modules)
        self.device, self.dtype = device, dtype
        self.state = LoraState()
        self.adapters: dict[str, LoadedAdapter] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()                      # the name table (intake reads it)
        n_slots = settings.max_loras_per_batch
        self.slot_uid = [0] * n_slots                      # uid held by each slot (0: free)
        self.slot_stamp = [0] * n_slots                    # LRU clock per slot
        self._clock = itertools.count(1)
        self.num_layers = len(model.layers)
        attn = model.first_attention()
        cfg: Any = model.config
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.dims = {"q_proj": (h, attn.q_size), "k_proj": (h, attn.kv_size), "v_proj": (h, attn.kv_size),
                     "o_proj": (attn.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
                     "down_proj": (inter, h)}
        fused_used = {HF_TARGETS[m][0] for m in self.allowed}
        self.projections: dict[tuple[int, str], LoraProjection] = {}
        r = settings.max_lora_rank
        for i, layer in enumerate(model.layers):
            for fused in sorted(fused_used):
                parent = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
                sizes = [self.dims[hf][1] for hf, (f, _) in sorted(HF_TARGETS.items(), key=lambda kv: kv[1][1])
                         if f == fused]
                d_in = self.dims[next(hf for hf, (f, _) in HF_TARGETS.items() if f == fused)][0]
                a = torch.zeros(n_slots, FUSED_SLICES[fused] * r, d_in, device=device, dtype=dtype)
                b = torch.zeros(n_slots, sum(sizes), r, device=device, dtype=dtype)
                proj = LoraProjection(sizes, self.state, a, b)
                proj.attach(getattr(parent, fused))        # a hook by name: the model file is unchanged
                self.projections[(i, fused)] = proj
        log.info("LoRA: %d slots of rank %d over %s (%.1f MiB reserved)", n_slots, r,
                 ", ".join(sorted(fused_used)), self.pool_bytes / 2**20)

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.projections.values())

    @property
    def host_bytes(self) -> int:
        return sum(a.weights.nbytes for a in self.adapters.values())

    # -- the name table (any thread) ---------------------------------------------------------------

    def read(self, name: str, path: str) -> LoraWeights:
        """Read and check an adapter's files (slow; no lock). InvalidArgument says what is wrong."""
        if not name:
            raise InvalidArgument("lora_name", "required")
        if not path:
            raise InvalidArgument("lora_path", "required")
        try:
            return load_adapter(name, path, num_layers=self.num_layers, dims=self.dims, allowed=self.allowed,
                                max_rank=self.settings.max_lora_rank)
        except AdapterError as e:
            raise InvalidArgument("lora_path", str(e)) from None

    def add(self, weights: LoraWeights, pinned: bool) -> LoadedAdapter:
        """Register what `read` returned (the caller holds the engine lock when pinning)."""
        with self._lock:
            if weights.name in self.adapters:
                raise AlreadyExists(f"lora_name: adapter {weights.name!r} is already loaded "
                                    f"(from {self.adapters[weights.name].weights.path}); unload it first")
            if len(self.adapters) >= self.settings.max_loaded_loras:
                raise ResourceExhausted(f"{len(self.adapters)} adapters are loaded, the most "
                                        f"--max-loaded-loras allows; unload one first")
            if pinned and sum(a.pinned for a in self.adapters.values()) + 1 >= self.settings.max_loras_per_batch:
                raise ResourceExhausted(f"lora_name: pinning {weights.name!r} would leave no slot of "
                                        f"--max-loras-per-batch {self.settings.max_loras_per_batch} for the others")
            loaded = LoadedAdapter(next(self._uids), weights, pinned)
            self.adapters[weights.name] = loaded
        if pinned:
            self._fill(self._free_slot(set()), loaded)
        log.info("lora adapter %s loaded from %s: rank %d, %s, uid %d%s", weights.name, weights.path, weights.rank,
                 ",".join(sorted(weights.targets)), loaded.uid, " (pinned)" if pinned else "")
        return loaded

    def remove(self, name: str) -> LoadedAdapter:
        """Forget an adapter and free its slot (the caller holds the engine lock and has checked that no
        request uses it)."""
        with self._lock:
            gone = self.adapters.pop(name, None)
        if gone is None:
            raise NotFound(f"lora_name: adapter {name!r} is not loaded")
        for s, uid in enumerate(self.slot_uid):
            if uid == gone.uid:
                self.slot_uid[s] = 0
        log.info("lora adapter %s unloaded (uid %d)", name, gone.uid)
        return gone

    def resolve(self, name: str) -> int:
        """The uid of a loaded adapter; NotFound naming it."""
        with self._lock:
            a = self.adapters.get(name)
        if a is None:
            raise NotFound(f"lora_path: adapter {name!r} is not loaded")
        return a.uid

    def listing(self) -> list[LoadedAdapter]:
        with self._lock:
            return sorted(self.adapters.values(), key=lambda a: a.uid)

    # -- the forward (engine thread, under the step lock) ----------------------------------------

    def begin(self, uids: list[int], extend_lens: list[int]) -> None:
        """Put the batch's adapters into slots and set the plan the hooks read. uids: [B] per request
        (0: none); at most max_loras_per_batch distinct (the scheduler's admission guarantees it)."""
        wanted = set(uids) - {0}
        if not wanted:
            self.state.active = None
            return
        by_uid = {a.uid: a for a in self.adapters.values()}
        slot_of: dict[int, int] = {}
        for s, uid in enumerate(self.slot_uid):
            if uid in wanted:
                slot_of[uid] = s
        for uid in wanted - set(slot_of):
            loaded = by_uid.get(uid)
            if loaded is None:  # unload checks for users first; this would be a bug
                raise RuntimeError(f"LoRA adapter uid {uid} is in a batch but not loaded")
            s = self._free_slot(set(slot_of.values()))
            self._fill(s, loaded)
            slot_of[uid] = s
        stamp = next(self._clock)
        for s in slot_of.values():
            self.slot_stamp[s] = stamp
        self.state.active = plan_rows([slot_of.get(u, -1) for u in uids], extend_lens, self.device)

    def end(self) -> None:
        self.state.active = None

    def _free_slot(self, in_use: set[int]) -> int:
        pinned = {a.uid for a in self.adapters.values() if a.pinned}
        free = [s for s, uid in enumerate(self.slot_uid) if uid == 0]
        if free:
            return free[0]
        candidates = [s for s, uid in enumerate(self.slot_uid) if s not in in_use and uid not in pinned]
        if not candidates:
            raise RuntimeError("no LoRA slot free: more adapters in one batch than --max-loras-per-batch")
        return min(candidates, key=lambda s: self.slot_stamp[s])

    @torch.no_grad()
    def _fill(self, slot: int, loaded: LoadedAdapter) -> None:
        """Copy an adapter's host tensors into a slot; modules it does not adapt get zeros."""
        r = self.settings.max_lora_rank
        for (layer, fused), w in self.projections.items():
            w.lora_a[slot].zero_()
            w.lora_b[slot].zero_()
            for hf, (f, j) in HF_TARGETS.items():
                t = loaded.weights.tensors.get((layer, hf)) if f == fused else None
                if t is None:
                    continue
                a, b = t  # [rank, in], [out, rank]
                rank = a.shape[0]
                off, n = w.offsets[j], w.sizes[j]
                w.lora_a[slot, j * r:j * r + rank].copy_(a)
                w.lora_b[slot, off:off + n, :rank].copy_(b)
        self.slot_uid[slot] = loaded.uid
        self.slot_stamp[slot] = next(self._clock)
