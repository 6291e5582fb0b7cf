"""KV memory: which pool slots each request's positions use, and the per-layer K/V buffers.

Two levels, as in SGLang:
- `ReqToTokenPool`: one row per running request; `req_to_token[row, pos]` is the KV slot of `pos`.
- `TokenToKVPool`: `size` token slots, each holding K and V for every layer. Slot 0 is reserved as a
  dummy (padding rows of a CUDA-graph batch write there), so valid slots are 1..size.

Allocation is a free list kept as a tensor on the pool's device: `alloc(n)` slices its head (no copy),
`free` appends to a list that is merged only when an allocation needs it, so a decode step's
`alloc(B)` and a finishing request's `free` are both a few microseconds.
"""

from __future__ import annotations

import torch


def doubled(cap: int, need: int, floor: int) -> int:
    """A buffer dimension grown by doubling from max(cap, floor) until it holds `need`."""
    new = max(cap, floor)
    while new < need:
        new *= 2
    return new


def rounded(need: int, multiple: int) -> int:
    """need rounded up to a multiple of `multiple`."""
    return -(-need // multiple) * multiple


class ReqToTokenPool:
    """Rows of KV slot indices, one per running request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [size, max_context_len] int64 on device. Zero-filled: stale or unused entries always point at a
        # valid slot, so a padded gather past a request's length stays in bounds (it is masked out).
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = list(range(size - 1, -1, -1))  # pop() hands out row 0 first
        # Overlap scheduling (core/overlap.py): rows freed while a launched forward may still read
        # them wait here, tagged with that forward's number, until it has run. The scheduler writes a
        # new request's row on its own thread, out of the forwards' order, so handing the row out
        # at once could change what a forward in flight reads. `fence` 0: none in flight.
        self.fence = 0
        self._fenced: list[tuple[int, int]] = []  # (fence, row)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise ValueError(f"row {idx} out of range [0, {self.size})")
        if self.fence:
            self._fenced.append((self.fence, idx))
        else:
            self._free_rows.append(idx)

    def passed(self, fence: int) -> None:
        """The forward numbered `fence` (and every earlier one) has run: its rows are free."""
        keep = [(f, row) for f, row in self._fenced if f > fence]
        self._free_rows.extend(row for f, row in self._fenced if f <= fence)
        self._fenced = keep

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._fenced = []


# fp8 KV (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, CPU C kernels): the largest finite value, where stores
# saturate (torch's cast gives NaN or infinity past it).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as KV elements of `dtype`, as the C kernels store them (fp8: saturated, then to nearest even)."""
    top = FP8_MAX.get(dtype)
    return x.to(dtype) if top is None else x.clamp(-top, top).to(dtype)


class TokenToKVPool:
    """Per-layer K and V buffers of `size + 1` token slots (slot 0 is the never-allocated dummy)."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        # num_layers x [size + 1, num_kv_heads, head_dim] dtype on device
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.clear()

    @property
    def num_slots(self) -> int:
        """Rows of each K/V buffer: slot 0 (padding) and the `size` allocatable ones."""
        return self.size + 1

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def clear(self) -> None:
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)  # [n_free]
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    def available_size(self) -> int:
        return self._free_slots.numel() + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """[n] int64 slots on device, or None (and nothing allocated) when fewer than n are free."""
        if n > self._free_slots.numel():
            if n > self.available_size():
                return None
            self._merge_released()
        out = self._free_slots[:n]
        self._free_slots = self._free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self._released.append(slots.reshape(-1).to(device=self.device, dtype=torch.int64))
        self._num_released += slots.numel()

    def _merge_released(self) -> None:
        self._free_slots = torch.cat([self._free_slots, *self._released])
        self._released.clear()
        self._num_released = 0

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc: [T] int64 slots; k, v: [T, num_kv_heads, head_dim]."""
        for buf, x in ((self.k_buffer[layer_id], k), (self.v_buffer[layer_id], v)):
            x = to_kv(x, self.dtype)
            if self.dtype in FP8_MAX:  # torch has no index_copy_ for fp8: as bytes
                buf, x = buf.view(torch.uint8), x.view(torch.uint8)
            buf.index_copy_(0, loc, x)
