"""The LoRA'd linear: base output plus each row's low-rank update, segmented by adapter.

Tokens are packed [T, in] with each request's tokens contiguous (forward_batch.py), so the rows of
one adapter are a few ranges. Per forward, `LoraBatch` groups the rows by pool slot once (every layer
reuses it); each LoRA'd linear then runs, per adapter in the batch, a shrink (x @ A^T, [t, n*R]) and an
expand per output slice ([t, R] @ B^T) on that adapter's rows: S-LoRA's segmented computation with
plain torch ops, the same on CPU and CUDA. Rows without an adapter cost nothing, and a forward with no
adapter at all returns from the hook at once (`active` is None).

Ranks below --max-lora-rank are zero-padded in the pool, which leaves the product exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Rows = slice | torch.Tensor  # a contiguous range of packed rows, or [t] int64 row indices


@dataclass
class LoraBatch:
    """One forward's plan: for each pool slot used, the packed rows that take its update."""

    groups: list[tuple[int, Rows]]


class LoraState:
    """Shared by every projection of a model: the plan of the forward now running (None: no adapter)."""

    def __init__(self) -> None:
        self.active: LoraBatch | None = None


class LoraProjection:
    """The LoRA update of one target linear (nn.Linear or the CPU's PackedLinear) of output `sizes`
    slices, applied by a forward hook: the module itself, its name and its parameters stay as they
    are, so weight loading, weight updates and CPU repacking see the model unchanged.

    a: [S, n * R, in] (slice j's A in rows j*R..), b: [S, out, R] (each output row's B, scaling folded),
    where S = --max-loras-per-batch and R = --max-lora-rank."""

    def __init__(self, sizes: list[int], state: LoraState, a: torch.Tensor, b: torch.Tensor) -> None:
        self.sizes = sizes
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self.rank = b.shape[2]
        self.state = state
        self.lora_a, self.lora_b = a, b

    def attach(self, module: nn.Module) -> None:
        module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor | None:
        plan = self.state.active
        if plan is None:
            return None  # the base output as it is
        return self.add_updates(args[0], y, plan)

    def add_updates(self, x: torch.Tensor, y: torch.Tensor, plan: LoraBatch) -> torch.Tensor:
        """y += each planned row's update; x: [T, in], y: [T, out] (the linear's fresh output)."""
        r = self.rank
        for slot, rows in plan.groups:
            xs = x[rows]                                   # [t, in]
            xa = xs @ self.lora_a[slot].T                  # [t, n * R]
            b = self.lora_b[slot]                          # [out, R]
            if len(self.sizes) == 1:
                delta = xa @ b.T                           # [t, out]
            else:
                delta = torch.cat([xa[:, j * r:(j + 1) * r] @ b[off:off + n].T
                                   for j, (off, n) in enumerate(zip(self.offsets, self.sizes))], dim=1)
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y


def plan_rows(slots: list[int], extend_lens: list[int], device: torch.device) -> LoraBatch | None:
    """The plan for a batch whose request b has extend_lens[b] packed rows and pool slot slots[b]
    (-1: no adapter). None when no request has one."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for s, n in zip(slots, extend_lens, strict=True):
        if s >= 0:
            rs = ranges.setdefault(s, [])
            if rs and rs[-1][1] == start:  # extends the previous range of the same adapter
                rs[-1] = (rs[-1][0], start + n)
            else:
                rs.append((start, start + n))
        start += n
    if not ranges:
        return None
    groups: list[tuple[int, Rows]] = []
    for s, rs in ranges.items():
        if len(rs) == 1:
            groups.append((s, slice(rs[0][0], rs[0][1])))
        else:
            idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in rs])
            groups.append((s, idx.to(device)))
    return LoraBatch(groups)
