"""Dense copies of the running batch's K/V, so CPU decode does not gather the pool every step.

The KV pool is token-indexed (the radix cache shares prefix slots between requests), so attending
over it means gathering every request's slots into a padded [B, Hkv, L, D] tensor, for every layer,
every step. On a CPU that gather is memory bound and costs more than the attention itself (measured:
2.6 ms per layer for K alone at B=64, L=320, against 1.2 ms for the SDPA call). Decode batches change
slowly, so this cache keeps each running request's K/V in a dense row that persists across steps:

- a request entering decode gets a row, filled once from the pool (its slots, all layers);
- each step writes only the new token's K/V into the rows (and, as always, into the pool);
- a request that left the batch (finished, aborted, retracted) frees its row: with `native` the
  row becomes a hole that the next request to join takes (the C kernel reads each request's row
  through an index; holes at the end are dropped), else the last row moves into it, so rows 0..B-1
  are exactly the batch, in some order, as the torch path's views want;
- an EXTEND pass for a request drops its row: a (re)prefilled request, or a req_to_token row reused
  by a new request, is never read from a stale copy.

The pool stays the source of truth; this is a cache that can be dropped at any time (`reset`), and
it declines (returns None) when its buffers would exceed `max_bytes` (--decode-cache-mib; by default
twice the pool's bytes, at least 1 GiB: `default_budget`); it grows by doubling while that fits, else
to just what the batch needs. The engine drops it (`reset`) once the scheduler is idle, so buffers
grown for a burst are returned when the burst is over (memory.py).

With `native` (the C decode kernel reads the rows), a request joining the batch whose first slots
are another running request's (a prefix shared through the radix cache) gets that prefix from one
shared copy (shared_prefix.py); its row holds only the positions after it, from index 0. A running
request whose row holds its whole sequence moves onto a copy created for its prompt later (`_adopt`).
"""

from __future__ import annotations

import torch

from services.scheduler.attention.shared_prefix import MIN_SHARED, SharedPrefixes
from services.scheduler.kernels.cpu_kernels import (
    KT_BLOCK,
    DecodeLayout,
    NativeKernels,
    blocked_kt,
    decode_layout,
    kt_blocks,
    kt_positions,
)
from services.scheduler.kvcache.memory_pool import TokenToKVPool, doubled, rounded

MIN_BUDGET = 1 << 30   # bytes the dense rows may take at least ...
POOL_MULTIPLE = 2      # ... or this many times the KV pool's, whichever is more


def default_budget(pool_bytes: int) -> int:
    """Bytes the dense rows may take by default. The rows are padded to the longest, so a batch that
    fits the pool can need more than the pool's bytes here; without this cache a decode step gathers
    the pool (far slower)."""
    return max(MIN_BUDGET, POOL_MULTIPLE * pool_bytes)


def shared_budget(max_bytes: int) -> int:
    """Bytes the shared-prefix copies may take besides the rows' max_bytes."""
    return max_bytes // 4


class DecodeRows:
    """Where a decode batch lives in the dense cache: B requests in R dense rows (R > B when some rows
    are holes, which only the C kernel's cache has)."""

    def __init__(self, rows: torch.Tensor, inv: torch.Tensor, seq_lens_rows: torch.Tensor, new_pos: torch.Tensor,
                 kv_len: int, entry_rows: torch.Tensor | None = None, plen_rows: torch.Tensor | None = None) -> None:
        self.rows = rows                  # [B] int64: dense row of batch position b
        self.inv = inv                    # [R] int64: batch position held by dense row r (-1: a hole)
        self.seq_lens_rows = seq_lens_rows  # [R] int64: seq_len of each dense row (0: a hole)
        self.new_pos = new_pos            # [B] int64: index of batch position b's new token in its row
        self.kv_len = kv_len              # L: longest sequence in the batch
        # With shared prefixes, per dense row: its prefix entry (-1: none) and that prefix's length.
        self.entry_rows = entry_rows
        self.plen_rows = plen_rows


class DenseDecodeCache:
    def __init__(self, kv_pool: TokenToKVPool, req_to_token: torch.Tensor, num_layers: int,
                 max_context_len: int, max_bytes: int | None = None, native: NativeKernels | None = None,
                 tiles: bool = False) -> None:
        """native: the C kernels read the rows (and fill them from the pool); None: the torch path. tiles:
        shared prefixes go on AMX tiles (the backend's choice, NativeKernels.tiles_for)."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_layers = num_layers
        self.max_context_len = max_context_len
        self.max_bytes = default_budget(kv_pool.bytes_per_token * kv_pool.size) if max_bytes is None else max_bytes
        self.row_of: dict[int, int] = {}  # req_pool_idx -> dense row
        self.req_at: list[int] = []       # dense row -> req_pool_idx
        # K is kept transposed, so q @ K^T streams each row's keys position-contiguous (torch: 0.63
        # against 0.87 ms per layer at B=64, L=320 on one core; the C kernel vectorizes over positions).
        self.k: list[torch.Tensor] = []   # per layer [B_cap, Hkv, D, L_cap]; blocked with the C kernels
        self.v: list[torch.Tensor] = []   # per layer [B_cap, Hkv, L_cap, D]
        self.native = native
        self.shared = (SharedPrefixes(kv_pool, num_layers, shared_budget(self.max_bytes), tiles) if native is not None
                       else None)
        self.entry_at: list[int] = []     # dense row -> its shared prefix entry (-1: none)
        self.plen_at: list[int] = []      # dense row -> that prefix's length (its row starts after it)
        self.len_at: list[int] = []       # dense row -> positions written in it (after the prefix)
        self.holes: set[int] = set()      # rows below len(req_at) that hold no request (native only)

    def reset(self) -> None:
        self.row_of.clear()
        self.req_at.clear()
        self.entry_at.clear()
        self.plen_at.clear()
        self.len_at.clear()
        self.holes.clear()
        self.k, self.v = [], []
        if self.shared is not None:
            self.shared.reset()

    def held_bytes(self) -> int:
        """Bytes of the rows' buffers (reserved: pages not yet written are counted too)."""
        return sum(t.nbytes for t in (*self.k, *self.v))

    def invalidate(self, req_pool_indices: list[int]) -> None:
        for idx in req_pool_indices:
            if idx in self.row_of:
                self._remove(idx)

    def _remove(self, idx: int) -> None:
        row = self.row_of.pop(idx)
        if self.entry_at[row] >= 0:
            assert self.shared is not None
            self.shared.release(self.entry_at[row])
        if self.native is not None:
            # A hole, not a move: moving the last row copied its keys in every layer (~1 ms a request
            # of 128 keys on SmolLM2-135M; 20+ ms of a step where many requests finish together).
            self.req_at[row], self.entry_at[row], self.plen_at[row], self.len_at[row] = -1, -1, 0, 0
            self.holes.add(row)
            while self.req_at and self.req_at[-1] < 0:
                self.holes.discard(len(self.req_at) - 1)
                for rows in (self.req_at, self.entry_at, self.plen_at, self.len_at):
                    rows.pop()
            return
        last = len(self.req_at) - 1
        if row != last:  # move the last row into the hole: its written positions, not its whole capacity
            moved, n = self.req_at[last], self.len_at[last]
            for k, v in zip(self.k, self.v):
                k[row, :, :, :n].copy_(k[last, :, :, :n])
                v[row, :, :n].copy_(v[last, :, :n])
            self.req_at[row] = moved
            self.entry_at[row], self.plen_at[row], self.len_at[row] = (
                self.entry_at[last], self.plen_at[last], self.len_at[last])
            self.row_of[moved] = row
        self.req_at.pop()
        self.entry_at.pop()
        self.plen_at.pop()
        self.len_at.pop()

    def _capacity(self) -> tuple[int, int]:
        return (self.v[0].shape[0], self.v[0].shape[2]) if self.v else (0, 0)

    def _ensure(self, batch_size: int, kv_len: int) -> bool:
        """Grow the buffers (doubling) to hold batch_size rows of kv_len; False if over budget."""
        b_cap, l_cap = self._capacity()
        if batch_size <= b_cap and kv_len <= l_cap:
            return True
        pool = self.kv_pool
        heads, dim = pool.k_buffer[0].shape[1], pool.k_buffer[0].shape[2]
        # Doubling when it fits the budget (few regrowths), else just what this batch needs. Growing for
        # rows sizes the positions for this batch, not for an earlier one: every K^T row is touched
        # across its whole capacity when filled, so a capacity left by one long request (or a warm-up)
        # costs page faults on each request that joins.
        # The C kernels' rows hold K^T in blocks of KT_BLOCK positions (cpu_kernels.kt_blocks), so their
        # capacity is a multiple of it. The torch path's rows are position-major, +16 positions: K^T rows at
        # a power-of-two stride (4 KiB at L=1024) alias in the L1 cache (measured: 1.4 against 1.17 ms per
        # layer at L=600).
        pad = 0 if self.native is not None else 16
        used_l = l_cap - pad if kv_len > l_cap else 0
        doubling = (doubled(b_cap, batch_size, 8), doubled(used_l, kv_len, 64))
        tight = (max(b_cap, rounded(batch_size, 8)), max(l_cap - pad, rounded(kv_len, 64)))
        for new_b, new_l in (doubling, tight):
            new_l = min(new_l, max(self.max_context_len, kv_len))
            new_l = rounded(new_l, KT_BLOCK) if self.native is not None else new_l + 16
            if new_b * new_l * pool.bytes_per_token <= self.max_bytes:
                break
        else:
            return False
        used = len(self.req_at)
        written = max(self.len_at, default=0)  # positions any row holds
        # The C kernel reads no position past a row's length, so its buffers need no zeroing: growing
        # them then costs only the pages really written (zeroing 64 rows x 1,312 positions, 344 MB,
        # took 120 ms of one decode step). The torch path masks scores, and 0 x NaN would still be NaN.
        new = torch.empty if self.native is not None else torch.zeros
        grown_k, grown_v = [], []
        for layer in range(self.num_layers):
            k = new(new_b, heads, dim, new_l, dtype=pool.dtype, device=pool.device)
            v = new(new_b, heads, new_l, dim, dtype=pool.dtype, device=pool.device)
            if self.k and written:
                if self.native is not None:  # the blocks that hold the written positions
                    nb = -(-written // KT_BLOCK)
                    kt_blocks(k)[:used, :, :nb].copy_(kt_blocks(self.k[layer])[:used, :, :nb])
                else:
                    k[:used, :, :, :written].copy_(self.k[layer][:used, :, :, :written])
                v[:used, :, :written].copy_(self.v[layer][:used, :, :written])
            grown_k.append(k)
            grown_v.append(v)
        self.k, self.v = grown_k, grown_v
        return True

    def _fill(self, joins: list[tuple[int, int, int, int]]) -> None:
        """For each (row, idx, start, end): copy positions [start, end) of request row `idx` from the pool
        into dense row `row`, from 0. The C kernel takes all of a step's joining requests in one call per
        layer (64 requests of 128 keys on SmolLM2-135M, one thread, rows already paged in: 95-118 ms
        against 160-169 for torch's two copies per request and layer; a busy 2-core machine)."""
        joins = [j for j in joins if j[3] > j[2]]
        if not joins:
            return
        if self.native is not None:
            slots = torch.cat([self.req_to_token[idx, start:end] for _, idx, start, end in joins])
            bounds = torch.zeros(len(joins) + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor([end - start for _, _, start, end in joins], dtype=torch.int64), 0,
                         out=bounds[1:])
            rows = torch.tensor([row for row, _, _, _ in joins], dtype=torch.int64)
            for layer in range(self.num_layers):
                self.native.fill_rows(self.kv_pool.get_kv_buffer(layer), slots, bounds, rows, self.k[layer],
                                      self.v[layer])
            return
        for row, idx, start, end in joins:
            slots = self.req_to_token[idx, start:end]
            for layer in range(self.num_layers):
                kb, vb = self.kv_pool.get_kv_buffer(layer)
                self.k[layer][row, :, :, :end - start].copy_(kb.index_select(0, slots).permute(1, 2, 0))
                self.v[layer][row, :, :end - start].copy_(vb.index_select(0, slots).transpose(0, 1))

    def _share(self, idx: int, written: int, batch: list[int], seq_of: dict[int, int]) -> tuple[int, int, bool]:
        """(entry, prefix length, whether this call created the entry) for a request joining the batch with
        `written` positions in the pool; (-1, 0, False) when it shares no prefix of MIN_SHARED+ tokens with a
        request of this batch."""
        if self.shared is None or written < MIN_SHARED:
            return -1, 0, False
        mine = self.req_to_token[idx, :written]
        e = self.shared.find(mine)
        if e is not None:
            self.shared.acquire(e)
            return e, len(self.shared.slots[e]), False  # type: ignore[arg-type]
        # A common prefix with another request of the batch (its first slot first: usually none).
        others = torch.tensor([i for i in batch if i != idx], dtype=torch.int64)
        if others.numel() == 0:
            return -1, 0, False
        others = others[self.req_to_token[others, 0] == mine[0]]
        if others.numel() == 0:
            return -1, 0, False
        same = (self.req_to_token[others, :written] == mine).to(torch.int32).cumprod(1).sum(1)
        written_by = torch.tensor([seq_of[int(i)] - 1 for i in others], dtype=torch.int64)
        common = int(torch.minimum(same, written_by).max())
        if common < MIN_SHARED or (e := self.shared.create(mine[:common])) is None:
            return -1, 0, False
        self.shared.acquire(e)
        return e, common, True

    def _adopt(self, created: set[int]) -> None:
        """Rows that hold their whole sequence and start with a prefix entry created this step read the
        prefix from it too, their own positions moved to the front of the row. A burst's first request
        on a prompt usually decodes alone before the others join; adopted, its row no longer sets the
        positions of every row (a K^T row is touched across its whole capacity when filled)."""
        shared = self.shared
        if shared is None:
            return
        for e in created:
            slots = shared.slots[e]
            assert slots is not None
            p = len(slots)
            for row, idx in enumerate(self.req_at):
                if idx < 0 or self.entry_at[row] >= 0 or self.len_at[row] < p:
                    continue
                if not torch.equal(self.req_to_token[idx, :p], slots):
                    continue
                n = self.len_at[row] - p  # positions after the prefix written so far
                for k, v in zip(self.k, self.v):  # the C kernels' rows: K^T blocked, moved in position order
                    kt = kt_positions(k[row])
                    kt[:, :, :n] = kt[:, :, p:p + n].clone()  # overlapping: through a copy
                    k[row].copy_(blocked_kt(kt))
                    v[row, :, :n].copy_(v[row, :, p:p + n].clone())
                shared.acquire(e)
                self.entry_at[row], self.plen_at[row], self.len_at[row] = e, p, n

    def prepare(self, req_pool_indices: list[int], seq_lens: list[int]) -> DecodeRows | None:
        """Make rows 0..B-1 hold exactly this decode batch; None when it would not fit the budget."""
        batch = set(req_pool_indices)
        for idx in [i for i in self.row_of if i not in batch]:
            self._remove(idx)
        seq_of = dict(zip(req_pool_indices, seq_lens))
        joining = {idx: self._share(idx, n - 1, req_pool_indices, seq_of)
                   for idx, n in seq_of.items() if idx not in self.row_of}
        self._adopt({e for e, _, created in joining.values() if created})
        own_len = max(n - (joining[i][1] if i in joining else self.plen_at[self.row_of[i]]) for i, n in seq_of.items())
        needed = len(self.req_at) + max(0, len(joining) - len(self.holes))  # rows, holes included
        if not self._ensure(needed, own_len):
            self.reset()
            return None
        rows = []
        joins = []  # (row, idx, start, end) of the requests joining the batch
        for idx, seq_len in zip(req_pool_indices, seq_lens):
            row = self.row_of.get(idx)
            if row is None:
                entry, plen, _ = joining[idx]
                if self.holes:  # the lowest, so that holes at the end can be dropped
                    row = min(self.holes)
                    self.holes.remove(row)
                    self.req_at[row], self.entry_at[row], self.plen_at[row], self.len_at[row] = idx, entry, plen, 0
                else:
                    row = len(self.req_at)
                    self.req_at.append(idx)
                    self.entry_at.append(entry)
                    self.plen_at.append(plen)
                    self.len_at.append(0)
                self.row_of[idx] = row
                joins.append((row, idx, plen, seq_len - 1))  # the newest token is written by this forward
            self.len_at[row] = seq_len - self.plen_at[row]
            rows.append(row)
        self._fill(joins)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        seq = torch.tensor(seq_lens, dtype=torch.int64)
        inv = torch.full((len(self.req_at),), -1, dtype=torch.int64)  # a hole: -1, and seq_len 0
        inv[rows_t] = torch.arange(len(rows), dtype=torch.int64)
        seq_rows = torch.zeros(len(self.req_at), dtype=torch.int64)
        seq_rows[rows_t] = seq
        plen_rows = torch.tensor(self.plen_at, dtype=torch.int64)
        new_pos = seq - 1 - plen_rows[rows_t]
        if self.shared is None or not len(self.shared):
            return DecodeRows(rows_t, inv, seq_rows, new_pos, max(seq_lens))
        return DecodeRows(rows_t, inv, seq_rows, new_pos, max(seq_lens),
                          torch.tensor(self.entry_at, dtype=torch.int64), plen_rows)

    def layout(self, rows: DecodeRows, loc: torch.Tensor) -> DecodeLayout:
        """This step's rows as the C kernels read them (checked once for every layer); loc: [B] int64
        pool slots of the new tokens."""
        _, l_cap = self._capacity()
        shared = self.shared if rows.entry_rows is not None else None
        return decode_layout(rows.seq_lens_rows, l_cap, rows.rows, rows.new_pos, loc, self.kv_pool.num_slots,
                             rows.entry_rows, rows.plen_rows, shared.k[0].shape[3] if shared else 0,
                             shared.k[0].shape[0] if shared else 0, shared is not None and shared.tiles)

    def prefix_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's shared prefixes, K^T [E, Hkv, D, Pcap] and V [E, Hkv, Pcap, D]; None when none."""
        if self.shared is None or not self.shared.k:
            return None
        return self.shared.k[layer], self.shared.v[layer]

    def write(self, layer: int, rows: DecodeRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, D] of the newest token of each batch position (the torch path)."""
        self.k[layer][rows.rows, :, :, rows.new_pos] = k.to(self.k[layer].dtype)
        self.v[layer][rows.rows, :, rows.new_pos] = v.to(self.v[layer].dtype)

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's whole K^T [B_cap, Hkv, D, L_cap] and V [B_cap, Hkv, L_cap, D] buffers (rows 0..B-1
        are the batch)."""
        return self.k[layer], self.v[layer]

    def kv(self, layer: int, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """K^T [B, Hkv, D, L] and V [B, Hkv, L, D]: views over the rows of this batch (row order)."""
        b = len(rows.rows)
        return self.k[layer][:b, :, :, :rows.kv_len], self.v[layer][:b, :, :rows.kv_len]
