"""One dense copy of a prompt prefix that several running requests share, for CPU decode attention.

With the radix cache, requests that share a prompt prefix share its KV slots in the pool. The dense
decode cache used to copy those keys into every request's row, so a decode step read the shared
prefix once per request (workload C: 16 copies of a 512-token system prompt per group). Here a
prefix is held once: rows that share it keep only their own positions after it, and the C kernel
scores a row's keys from the prefix buffer, then from its own row, into one array (same arithmetic as
one buffer). The prefix's keys stay in cache while the group's rows read them. Over an fp8 pool the copies
are bf16 (`prefix_dtype`: the same values; read from cache, bf16 widens with fewer instructions).

Under bf16 linears, where the CPU has AMX-BF16 and the copies are bf16 (`tiles`, the attention backend's
choice), the kernel computes the prefix part of a chunk of its rows' attention as two tile products
(attention.c, "Shared prefixes on AMX tiles"), and the copies are kept in the layout the tiles load: K^T
[E, H, D/2, Pcap, 2] and V [E, H, Pcap/2, D, 2] in the buffers' [E, H, D, Pcap] and [E, H, Pcap, D], Pcap a
multiple of TILE_ALIGN, V zero past each prefix up to it.

An entry is keyed by its slots: a request shares entry e iff its first len(e) slots in
`req_to_token` are e's slots (slots are unique to a live request unless shared through the radix
tree, and they cannot be freed while a request using the entry runs). Entries are refcounted by
rows and dropped with their last row.
"""

from __future__ import annotations

import torch

from services.scheduler.kernels.cpu_kernels import TILE_ALIGN, prefix_dtype
from services.scheduler.kvcache.memory_pool import TokenToKVPool, doubled

MIN_SHARED = 64  # shorter common prefixes are copied into each row as before


class SharedPrefixes:
    def __init__(self, kv_pool: TokenToKVPool, num_layers: int, max_bytes: int, tiles: bool = False) -> None:
        """tiles: the copies are in the tile layout (the attention backend chose tiles: NativeKernels.tiles_for)."""
        self.kv_pool = kv_pool
        self.num_layers = num_layers
        self.max_bytes = max_bytes
        self.tiles = tiles
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
        n = len(slots)
        for layer in range(self.num_layers):
            kb, vb = self.kv_pool.get_kv_buffer(layer)
            k, v = kb.index_select(0, slots), vb.index_select(0, slots)  # [P, H, D]
            if self.tiles:
                p, h, d = k.shape
                tiled_k(self.k[layer])[e, :, :, :n].copy_(k.view(p, h, d // 2, 2).permute(1, 2, 0, 3))
                padded = -(-n // TILE_ALIGN) * TILE_ALIGN  # the kernel's products read V up to here: zeros
                vp = torch.cat([v.to(self.v[layer].dtype), v.new_zeros(padded - n, h, d, dtype=self.v[layer].dtype)])
                tiled_v(self.v[layer])[e, :, :padded // 2].copy_(vp.view(padded // 2, 2, h, d).permute(2, 0, 3, 1))
            else:
                self.k[layer][e, :, :, :n].copy_(k.permute(1, 2, 0))
                self.v[layer][e, :, :n].copy_(v.transpose(0, 1))
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
        # The tile layout's Pcap is a multiple of TILE_ALIGN, and the kernel reads a prefix up to its
        # length rounded up to it.
        need = -(-length // TILE_ALIGN) * TILE_ALIGN if self.tiles else length
        if entries <= e_cap and need <= p_cap:
            return True
        # + 16 (+ TILE_ALIGN): off a power-of-two stride, as the rows (decode_cache.py)
        new_e, new_p = doubled(e_cap, entries, 4), doubled(p_cap, need, 64) + (TILE_ALIGN if self.tiles else 16)
        pool = self.kv_pool
        heads, dim = pool.k_buffer[0].shape[1], pool.k_buffer[0].shape[2]
        dtype = prefix_dtype(pool.dtype)  # fp8 pools: bf16 copies (the same values)
        if new_e * new_p * 2 * self.num_layers * heads * dim * dtype.itemsize > self.max_bytes:  # K and V
            return False
        k_new, v_new = [], []
        for layer in range(self.num_layers):
            # Only the C kernel reads these, never past a prefix's length (tiles: V is zeroed there by
            # `create`): no zeroing (decode_cache.py).
            k = torch.empty(new_e, heads, dim, new_p, dtype=dtype, device=pool.device)
            v = torch.empty(new_e, heads, new_p, dim, dtype=dtype, device=pool.device)
            if self.v and self.tiles:
                tiled_k(k)[:e_cap, :, :, :p_cap].copy_(tiled_k(self.k[layer]))
                tiled_v(v)[:e_cap, :, :p_cap // 2].copy_(tiled_v(self.v[layer]))
            elif self.v:
                k[:e_cap, :, :, :p_cap].copy_(self.k[layer])
                v[:e_cap, :, :p_cap].copy_(self.v[layer])
            k_new.append(k)
            v_new.append(v)
        self.k, self.v = k_new, v_new
        return True


def tiled_k(k: torch.Tensor) -> torch.Tensor:
    """A K^T buffer [E, H, D, Pcap] in the tile layout, as it is laid out: [E, H, D/2, Pcap, 2]."""
    e, h, d, p = k.shape
    return k.view(e, h, d // 2, p, 2)


def tiled_v(v: torch.Tensor) -> torch.Tensor:
    """A V buffer [E, H, Pcap, D] in the tile layout, as it is laid out: [E, H, Pcap/2, D, 2]."""
    e, h, p, d = v.shape
    return v.view(e, h, p // 2, d, 2)
