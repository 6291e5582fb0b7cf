"""One dense copy of a prompt prefix that several running requests share, for CPU decode attention.

With the radix cache, requests that share a prompt prefix share its KV slots in the pool. The dense
decode cache used to copy those keys into every request's row, so a decode step read the shared
prefix once per request (workload C: 16 copies of a 512-token system prompt per group). Here a
prefix is held once: rows that share it keep only their own positions after it, and the C kernel
scores a row's keys from the prefix buffer, then from its own row, into one array (same arithmetic as
one buffer). The prefix's keys stay in cache while the group's rows read them. Over an fp8 pool the copies
are bf16 (`prefix_dtype`: the same values; read from cache, bf16 widens with fewer instructions).

An entry is keyed by its slots: a request shares entry e iff its first len(e) slots in
`req_to_token` are e's slots (slots are unique to a live request unless shared through the radix
tree, and they cannot be freed while a request using the entry runs). Entries are refcounted by
rows and dropped with their last row.
"""

from __future__ import annotations

import torch

from services.scheduler.kernels.cpu_kernels import prefix_dtype
from services.scheduler.kvcache.memory_pool import TokenToKVPool, doubled

MIN_SHARED = 64  # shorter common prefixes are copied into each row as before


class SharedPrefixes:
    def __init__(self, kv_pool: TokenToKVPool, num_layers: int, max_bytes: int) -> None:
        self.kv_pool = kv_pool
        self.num_layers = num_layers
        self.max_bytes = max_bytes
        self.slots: list[torch.Tensor | None] = []  # entry -> its slots [P] int64; None: free
        self.refs: list[int] = []
        self.k: list[torch.Tensor] = []  # per layer [E_cap, Hkv, D, P_cap] (K^T)
        self.v: list[torch.Tensor] = []  # per layer [E_cap, Hkv, P_cap, D]

    def reset(self) -> None:
        self.slots.clear()
        self.refs.clear()
        self.k, self.v = [], []

    def held_bytes(self) -> int:
        """Bytes of the entries' buffers (reserved, written or not)."""
        return sum(t.nbytes for t in (*self.k, *self.v))

    def __len__(self) -> int:
        return sum(s is not None for s in self.slots)

    def find(self, row_slots: torch.Tensor) -> int | None:
        """The longest live entry whose slots start `row_slots` ([n] int64, the request's written ones)."""
        best, best_len = None, 0
        for e, slots in enumerate(self.slots):
            if slots is None:  # a free entry
                continue
            n = len(slots)
            if best_len < n <= len(row_slots) and torch.equal(row_slots[:n], slots):
                best, best_len = e, n
        return best

    def create(self, slots: torch.Tensor) -> int | None:
        """A new entry holding the pool's K/V at `slots` ([P] int64); None when over the byte budget."""
        free = [e for e, s in enumerate(self.slots) if s is None]
        e = free[0] if free else len(self.slots)
        if not self._ensure(e + 1, len(slots)):
            return None
        for layer in range(self.num_layers):
            kb, vb = self.kv_pool.get_kv_buffer(layer)
            self.k[layer][e, :, :, :len(slots)].copy_(kb.index_select(0, slots).permute(1, 2, 0))
            self.v[layer][e, :, :len(slots)].copy_(vb.index_select(0, slots).transpose(0, 1))
        if e == len(self.slots):
            self.slots.append(None)
            self.refs.append(0)
        self.slots[e], self.refs[e] = slots.clone(), 0
        return e

    def acquire(self, e: int) -> None:
        self.refs[e] += 1

    def release(self, e: int) -> None:
        self.refs[e] -= 1
        if self.refs[e] == 0:
            self.slots[e] = None

    def _ensure(self, entries: int, length: int) -> bool:
        e_cap, p_cap = (self.v[0].shape[0], self.v[0].shape[2]) if self.v else (0, 0)
        if entries <= e_cap and length <= p_cap:
            return True
        # + 16: off a power-of-two stride, as the rows (decode_cache.py)
        new_e, new_p = doubled(e_cap, entries, 4), doubled(p_cap, length, 64) + 16
        pool = self.kv_pool
        heads, dim = pool.k_buffer[0].shape[1], pool.k_buffer[0].shape[2]
        dtype = prefix_dtype(pool.dtype)  # fp8 pools: bf16 copies (the same values)
        if new_e * new_p * 2 * self.num_layers * heads * dim * dtype.itemsize > self.max_bytes:  # K and V
            return False
        k_new, v_new = [], []
        for layer in range(self.num_layers):
            # Only the C kernel reads these, never past a prefix's length: no zeroing (decode_cache.py).
            k = torch.empty(new_e, heads, dim, new_p, dtype=dtype, device=pool.device)
            v = torch.empty(new_e, heads, new_p, dim, dtype=dtype, device=pool.device)
            if self.v:
                k[:e_cap, :, :, :p_cap].copy_(self.k[layer])
                v[:e_cap, :, :p_cap].copy_(self.v[layer])
            k_new.append(k)
            v_new.append(v)
        self.k, self.v = k_new, v_new
        return True
