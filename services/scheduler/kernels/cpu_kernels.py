"""Native CPU kernels (csrc/*.c, built by kernel_build.py), called via ctypes: attention (decode and
prefill; a decode step's K/V store is part of the decode call), the dense decode rows' fill from the KV
pool, the fused elementwise steps of a layer (rotary, SiLU gate, the
residual add with its RMSNorm) and greedy argmax. Activations are float32; the attention kernels take
the KV cache in float32, bfloat16 or fp8 (`KV_DTYPES`: one dtype for pool and dense rows, the shared
prefixes' copies in its `prefix_dtype`).

`load()` returns None when there is no compiler (a slim image) or the build fails, and callers keep
their torch path. ctypes releases the GIL for the call. The C code trusts its pointers and sizes, so
the wrappers check them, where a mistake is an exception; what every layer of a decode step shares
(where each request's keys are) is checked once per step, in `decode_layout`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from services.scheduler.kernels.kernel_build import build

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # attention.c's GMAX and DMAX
# What the attention kernels read and write as KV, in attention.c's order of its kinds (KV_F32 ...).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# attention.c's KV_TILES, a flag of the kernels' KV kind: attention on AMX tiles (decode: the shared prefixes'
# part, their copies in the tile layout of shared_prefix.py; extend: all of it); TILE_ALIGN: the tile layout's
# Pcap is a multiple of it.
KV_TILES, TILE_ALIGN = 16, 32
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)  # the SiLU gate's and the norm's GEMM-side tensors
# decode_stack.c's per-layer columns (DS_*): the bf16 weights of qkv, o, gate_up and down, the two norms'
# weights, the dense rows' K^T and V, the shared prefixes' K^T and V, the KV pool's K and V, the window.
STACK_COLUMNS = ("qkv", "o", "gate_up", "down", "norm_in", "norm_post", "kt", "v", "prefix_k", "prefix_v",
                 "pool_k", "pool_v", "window")
# decode_stack.c's callback for the linears of larger steps: (layer, linear: its column in STACK_COLUMNS) ->
# the output's address (0: it failed).
STACK_GEMM = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
STACK_GEMM_FAILED = -2  # decode_stack_f32's return when the callback returned 0
_NO_GEMM = STACK_GEMM()  # NULL: the stack runs its own linear kernel


def kernel_supports(group: int, head_dim: int) -> bool:
    """Whether the attention kernels take this query group size and head_dim."""
    return 1 <= group <= MAX_GROUP and 1 <= head_dim <= MAX_HEAD_DIM


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class DecodeLayout:
    """A decode step's requests in the dense decode cache (decode_cache.py), checked once for every
    layer's calls. Request b (batch order) lives in dense row rows[b]; its new token goes to position
    new_pos[b] of that row and to KV pool slot loc[b]. Dense row r holds lens[r] keys, the first plen[r]
    of them in shared prefix entry[r] (entry None: no shared prefixes). All int64, contiguous."""
    rows: torch.Tensor                 # [B]
    lens: torch.Tensor                 # [R]
    l_cap: int                         # positions per dense row's buffer
    new_pos: torch.Tensor | None = None  # [B]
    loc: torch.Tensor | None = None      # [B]
    entry: torch.Tensor | None = None    # [R]
    plen: torch.Tensor | None = None     # [R]
    p_cap: int = 0                     # positions per shared prefix buffer
    entries: int = 0                   # shared prefix buffers in use
    # [B] the order the kernel takes the requests in (None: batch order): with shared prefixes, by
    # entry, so that the requests reading one prefix come one after another while it is in cache (a
    # benchmark's shuffled prompts interleave them; 64 rows on 4 prefixes of 512 keys, 2 threads: see
    # docs/internals.md)
    order: torch.Tensor | None = None
    prefix_tiles: bool = False         # the prefixes are in the tile layout (NativeKernels.prefix_tiles)


def decode_layout(lens: torch.Tensor, l_cap: int, rows: torch.Tensor | None = None,
                  new_pos: torch.Tensor | None = None, loc: torch.Tensor | None = None, pool_size: int = 0,
                  entry: torch.Tensor | None = None, plen: torch.Tensor | None = None, p_cap: int = 0,
                  entries: int = 0, prefix_tiles: bool = False) -> DecodeLayout:
    """Check where each request's keys are against the buffers' capacities (rows None: request b in
    dense row b; pool_size: slots of the KV pool, for loc; prefix_tiles: the prefixes' copies are in
    the tile layout, where a prefix is read up to its length rounded up to TILE_ALIGN)."""
    lens = lens.contiguous()
    rows = torch.arange(len(lens), dtype=torch.int64) if rows is None else rows.contiguous()
    for t in (lens, rows, new_pos, loc, entry, plen):
        assert t is None or (t.dtype == torch.int64 and t.device.type == "cpu" and t.dim() == 1)
    assert len(rows) >= 1 and 0 <= int(rows.min()) and int(rows.max()) < len(lens)
    own = lens
    if entry is not None:
        assert plen is not None and entry.shape == plen.shape == lens.shape
        entry, plen = entry.contiguous(), plen.contiguous()
        assert 0 <= int(plen.min()) and int(plen.max()) <= p_cap
        assert not prefix_tiles or (p_cap % TILE_ALIGN == 0 and -(-int(plen.max()) // TILE_ALIGN) * TILE_ALIGN <= p_cap)
        has = plen > 0
        assert bool(((entry >= 0) & (entry < entries))[has].all())
        own = lens - plen
        key = torch.where(plen[rows] > 0, entry[rows], -1)
        order = torch.sort(key, stable=True).indices
    else:
        order = None
    assert 1 <= int(own[rows].min()) and int(own[rows].max()) <= l_cap
    if new_pos is not None:
        assert new_pos.shape == rows.shape and 0 <= int(new_pos.min()) and int(new_pos.max()) < l_cap
        new_pos = new_pos.contiguous()
    if loc is not None:
        assert loc.shape == rows.shape and 0 <= int(loc.min()) and int(loc.max()) < pool_size
        loc = loc.contiguous()
    return DecodeLayout(rows, lens, l_cap, new_pos, loc, entry, plen, p_cap if entry is not None else 0,
                        entries, order, prefix_tiles and entry is not None)


@dataclass(frozen=True)
class ExtendLayout:
    """A prefill step's requests, checked once for every layer's call: request b's new tokens are rows
    q_start[b]:q_start[b + 1] of the step's T, after prefix[b] cached ones, and its keys sit in KV pool
    slots slots[b, :prefix[b] + new]. All int64, contiguous."""
    slots: torch.Tensor    # [B, Lcap]
    q_start: torch.Tensor  # [B + 1]
    prefix: torch.Tensor   # [B]
    tokens: int            # T
    pool_size: int         # slots are below this


def extend_layout(slots: torch.Tensor, q_start: torch.Tensor, prefix: torch.Tensor, pool_size: int) -> ExtendLayout:
    slots, q_start, prefix = slots.contiguous(), q_start.contiguous(), prefix.contiguous()
    for t in (slots, q_start, prefix):
        assert t.dtype == torch.int64 and t.device.type == "cpu"
    b = len(prefix)
    assert slots.dim() == 2 and slots.shape[0] == b and q_start.shape == (b + 1,) and prefix.shape == (b,)
    n = q_start[1:] - q_start[:-1]
    assert int(q_start[0]) == 0 and int(n.min()) >= 0 and int(prefix.min()) >= 0
    assert int((prefix + n).max()) <= slots.shape[1]
    # Past each request's keys its row holds an earlier request's slots or 0: in range either way.
    assert 0 <= int(slots.min()) and int(slots.max()) < pool_size
    return ExtendLayout(slots, q_start, prefix, int(q_start[-1]), pool_size)


KT_BLOCK = 64  # positions per block of the dense decode rows' K^T (csrc/attention.c, kt_at)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of their width (fp8 has no pad, strided copy or torch.equal of its own)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def kt_blocks(kt: torch.Tensor) -> torch.Tensor:
    """A dense-row K^T buffer [..., D, Lcap] as the C kernels fill it, viewed as its blocks
    [..., Lcap / KT_BLOCK, D, KT_BLOCK]: dim d of position p at [p // KT_BLOCK, d, p % KT_BLOCK]."""
    *lead, d, l_cap = kt.shape
    return kt.view(*lead, l_cap // KT_BLOCK, d, KT_BLOCK)


def kt_positions(kt: torch.Tensor) -> torch.Tensor:
    """A blocked dense-row K^T buffer [..., D, Lcap] in position order (a copy): [..., D, Lcap]."""
    *lead, d, l_cap = kt.shape
    return kt_blocks(bits(kt)).transpose(-3, -2).reshape(*lead, d, l_cap).view(kt.dtype)


def blocked_kt(kt: torch.Tensor) -> torch.Tensor:
    """K^T [..., D, L] in position order as the dense rows hold it (a copy), L padded to a multiple of
    KT_BLOCK with zeros: [..., D, Lcap]."""
    *lead, d, length = kt.shape
    l_cap = -(-length // KT_BLOCK) * KT_BLOCK
    out = kt.new_empty(*lead, d, l_cap)
    padded = torch.nn.functional.pad(bits(kt), (0, l_cap - length))
    kt_blocks(bits(out)).copy_(padded.view(*lead, d, l_cap // KT_BLOCK, KT_BLOCK).transpose(-3, -2))
    return out


def check_kv(kt_buf: torch.Tensor, v_buf: torch.Tensor, h: int, d: int, rows: int, l_cap: int,
             dtype: torch.dtype) -> None:
    for t in (kt_buf, v_buf):
        assert t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert kt_buf.shape[0] >= rows and kt_buf.shape[1:] == (h, d, l_cap)
    assert v_buf.shape == (kt_buf.shape[0], h, l_cap, d)


def prefix_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shared-prefix copies the decode kernel reads beside a KV cache of `kv_dtype`: the
    same, but bfloat16 for fp8 (attention.c's PREFIX_KV: the same values, cheaper to widen)."""
    return torch.bfloat16 if kv_dtype in KV_DTYPES[2:] else kv_dtype


def _kv_kind(dtype: torch.dtype, layout: DecodeLayout | None = None) -> int:
    """The kernels' `kv` argument for a KV buffer's dtype (and, for decode, its layout's prefix flag)."""
    assert dtype in KV_DTYPES, f"KV cache dtype {dtype}: the kernels take {KV_DTYPES}"
    return KV_DTYPES.index(dtype) | (KV_TILES if layout is not None and layout.prefix_tiles else 0)


def _rows_of_heads(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """x: [B, ...] in one of `dtypes`: each row's trailing dims contiguous, rows at any stride (no
    tensor op: per layer)."""
    assert x.dtype in dtypes and x.device.type == "cpu"
    step = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        assert size == 1 or stride == step
        step *= size
    assert x.shape[0] <= 1 or x.stride(0) >= step


class NativeKernels:
    """The library's entry points, for float32 tensors on CPU."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        self._decode = self._fn(lib.decode_attention_f32, ctypes.c_int, [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I,
                                                                         _I, _I, _I, _F, ctypes.c_int, _P, _P, _P,
                                                                         _P, _I, _I, _P, _I, _P, _I, _P, _P, _P,
                                                                         _P, ctypes.c_int])
        self._extend = self._fn(lib.extend_attention_f32, ctypes.c_int,
                                [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, ctypes.c_int, _I,
                                 ctypes.c_int])
        self._store_kv = self._fn(lib.store_kv_f32, ctypes.c_int, [_P, _I, _P, _I, _P, _P, _P, _I, _I, ctypes.c_int,
                                                                   ctypes.c_int])
        self._fill = self._fn(lib.fill_rows_f32, None, [_P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, ctypes.c_int,
                                                        ctypes.c_int])
        self._rope = self._fn(lib.rope_f32, None, [_P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int])
        self._silu_mul = self._fn(lib.silu_mul_f32, None, [_P, _P, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int])
        self._add_norm = self._fn(lib.add_rms_norm_f32, None, [_P, _I, _P, _I, _P, _P, _I, _I, _F, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int])
        self._argmax = self._fn(lib.argmax_rows_f32, None, [_P, _I, _I, _I, _P, ctypes.c_int])
        self._moe_gemm = self._fn(lib.moe_gemm_f32, None, [_P, _I, _P, _I, _I, _P, _I, _P, ctypes.c_int])
        self._linear_bf16 = self._fn(lib.linear_bf16w_f32, ctypes.c_int, [_P, _I, _I, _P, _I, _I, _P, ctypes.c_int])
        self._tiles_pack = self._fn(lib.linear_tiles_pack, ctypes.c_int, [_P, _P, _I, _I, ctypes.c_int])
        self._linear_tiles = self._fn(lib.linear_tiles, ctypes.c_int, [_P, _I, ctypes.c_int, _I, _P, _I, _I, _P,
                                                                      ctypes.c_int, ctypes.c_int])
        self._tiles_argmax = self._fn(lib.linear_tiles_argmax, ctypes.c_int, [_P, _I, ctypes.c_int, _I, _P, _I, _I,
                                                                              _P, ctypes.c_int])
        self._stack = self._fn(lib.decode_stack_f32, ctypes.c_int,
                               [_P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _I, _P, _P, _P, _I, _F, _P, _P,
                                _I, _P, _P, ctypes.c_int, _P, ctypes.c_int, STACK_GEMM, _P])
        self._stack_ws = self._fn(lib.decode_stack_workspace, _I, [_I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_int,
                                                                   ctypes.c_int])
        self._decode_scratch = self._fn(lib.decode_scratch, _I, [_I, _I, _I, _I, ctypes.c_int])
        self._extend_scratch = self._fn(lib.extend_scratch, _I, [_I, _I, _I, ctypes.c_int])
        # AMX tiles for shared prefixes: built for them (-march=native on a CPU with AMX-BF16) and granted
        # by the kernel (attention.c's prefix_tiles_ready).
        self.tiles = bool(self._fn(lib.prefix_tiles_ready, ctypes.c_int, [])())
        self._fp8_decode = self._fn(lib.fp8_decode, None, [_P, _P, _I, ctypes.c_int])
        self._fp8_encode = self._fn(lib.fp8_encode, None, [_P, _P, _I, ctypes.c_int])

    @staticmethod
    def _fn(f, restype, argtypes):
        f.argtypes, f.restype = argtypes, restype
        return f

    def tiles_for(self, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention over a KV cache of `kv_dtype` can run on AMX tiles here: the CPU has them, the
        cache is bf16 or fp8 (its values, and its shared prefixes' copies, are bf16 ones; float32 keeps
        float32 products) and head_dim is a multiple of 32."""
        return self.tiles and prefix_dtype(kv_dtype) == torch.bfloat16 and head_dim % 32 == 0

    def decode_attention(self, q: torch.Tensor, kt_buf: torch.Tensor, v_buf: torch.Tensor, layout: DecodeLayout,
                         scale: float, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                         window: int | None = None, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                         pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """window: the layer's sliding window (a row of n keys reads its last `window`); None: all.
        q: [B, H, G, D] float32 (each request's heads contiguous, requests at any stride); kt_buf: K^T
        [Bcap, H, D, Lcap] in blocks of KT_BLOCK positions (kt_blocks; blocked_kt makes one) and v_buf:
        [Bcap, H, Lcap, D], contiguous on CPU, one of KV_DTYPES (the KV
        dtype: the pool matches it, the prefixes are in its prefix_dtype); prefix: the shared
        prefixes' K^T [E, H, D, Pcap] and V [E, H, Pcap, D] when the layout has entries. new_kv: the
        step's new k, v ([B, H, D], each request's contiguous, any stride), first written at
        layout.new_pos of each request's dense row and, with `pool` ([S, H, D] K and V buffers), at pool
        slot layout.loc: the row's store and its read are one pass. Returns [B, H, G, D] in batch order."""
        b, h, g, d = q.shape
        _rows_of_heads(q)
        assert b == len(layout.rows)
        kv_dtype = kt_buf.dtype
        check_kv(kt_buf, v_buf, h, d, len(layout.lens), layout.l_cap, kv_dtype)
        assert layout.l_cap % KT_BLOCK == 0  # the rows' K^T in blocks (kt_blocks)
        ptrs: list[int | None] = [None] * 4
        if layout.entry is not None:
            assert prefix is not None and layout.plen is not None  # plen is set together with entry
            check_kv(prefix[0], prefix[1], h, d, layout.entries, layout.p_cap, prefix_dtype(kv_dtype))
            ptrs = [prefix[0].data_ptr(), prefix[1].data_ptr(), layout.entry.data_ptr(), layout.plen.data_ptr()]
        store: list[int | None] = [None, 0, None, 0, None, None, None, None]
        if new_kv is not None:
            k, v = new_kv
            _rows_of_heads(k)
            _rows_of_heads(v)
            assert k.shape == v.shape == (b, h, d) and layout.new_pos is not None
            store[:5] = [k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), layout.new_pos.data_ptr()]
            if pool is not None:
                assert layout.loc is not None
                for t in pool:
                    assert t.dtype == kv_dtype and t.is_contiguous() and t.shape[1:] == (h, d)
                store[5:] = [pool[0].data_ptr(), pool[1].data_ptr(), layout.loc.data_ptr()]
        else:
            assert pool is None, "the pool is written only with new_kv"
        out = q.new_empty(b, h, g, d)
        kind = _kv_kind(kv_dtype, layout)
        threads = torch.get_num_threads()  # the forward's own threads (set_num_threads / --num-threads)
        scratch = torch.empty(threads * self._decode_scratch(g, d, layout.p_cap, layout.l_cap, kind),
                              dtype=torch.float32)
        if self._decode(q.data_ptr(), q.stride(0), kt_buf.data_ptr(), v_buf.data_ptr(), layout.rows.data_ptr(),
                        _ptr(layout.order), layout.lens.data_ptr(), out.data_ptr(), scratch.data_ptr(), b, h, g, d,
                        layout.l_cap, scale, threads, *ptrs, layout.p_cap, window or 0, *store, kind) != 0:
            raise ValueError(f"attention kernel: unsupported group {g} / head_dim {d} / window {window} "
                             f"(max {MAX_GROUP} / {MAX_HEAD_DIM})")
        return out

    def fp8_values(self, codes: torch.Tensor) -> torch.Tensor:
        """The kernels' reading of fp8 KV elements: codes [N] float8_e4m3fn or float8_e5m2 -> float32."""
        assert codes.dtype in KV_DTYPES[2:] and codes.is_contiguous() and codes.dim() == 1
        out = torch.empty(len(codes), dtype=torch.float32)
        self._fp8_decode(codes.data_ptr(), out.data_ptr(), len(codes), _kv_kind(codes.dtype))
        return out

    def fp8_codes(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The kernels' stores of KV elements as fp8: x [N] float32 -> [N] `dtype` (an fp8 of KV_DTYPES)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 1 and dtype in KV_DTYPES[2:]
        out = torch.empty(len(x), dtype=dtype)
        self._fp8_encode(x.data_ptr(), out.data_ptr(), len(x), _kv_kind(dtype))
        return out

    def fill_rows(self, pool: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, start: torch.Tensor,
                  rows: torch.Tensor, kt_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """Copy request j's keys and values from the KV pool (pool: [S, H, D] K and V, contiguous, the KV dtype)
        at slots[start[j]:start[j + 1]] into dense row rows[j] from position 0 (kt_buf / v_buf as in
        decode_attention). slots: [N] int64 (each below S); start: [J + 1] int64 from 0 to N; rows: [J]
        int64 (each below Bcap); all contiguous."""
        pk, pv = pool
        s, h, d = pk.shape
        for t in (pk, pv):
            assert t.dtype == pk.dtype and t.device.type == "cpu" and t.is_contiguous() and t.shape == (s, h, d)
        for t in (slots, start, rows):
            assert t.dtype == torch.int64 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()
        j = len(rows)
        assert len(start) == j + 1 and int(start[0]) == 0 and int(start[-1]) == len(slots)
        if j == 0:
            return
        n = start[1:] - start[:-1]
        check_kv(kt_buf, v_buf, h, d, int(rows.max()) + 1, kt_buf.shape[3], pk.dtype)
        assert kt_buf.shape[3] % KT_BLOCK == 0  # the rows' K^T in blocks (kt_blocks)
        assert int(n.min()) >= 0 and int(n.max()) <= kt_buf.shape[3] and int(rows.min()) >= 0
        assert len(slots) == 0 or (int(slots.min()) >= 0 and int(slots.max()) < s)
        self._fill(pk.data_ptr(), pv.data_ptr(), slots.data_ptr(), start.data_ptr(), rows.data_ptr(), j, h, d,
                   kt_buf.data_ptr(), v_buf.data_ptr(), kt_buf.shape[3], torch.get_num_threads(), _kv_kind(pk.dtype))

    def extend_attention(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, layout: ExtendLayout,
                         scale: float, window: int | None = None, tiles: bool = False) -> torch.Tensor:
        """Causal attention of new tokens after cached ones, keys read from the KV pool. q: [T, H, G, D]
        float32, each token's heads contiguous, tokens at any stride (a view of the qkv rows); pool_k,
        pool_v: [S, H, D] contiguous, one of KV_DTYPES (S >= layout.pool_size). Token
        i of request b sees keys [0, prefix[b] + i], with a sliding window only the last `window` of
        them. Returns [T, H, G, D]. tiles: on AMX tiles (bf16 products: attention.c's extend_tile_task),
        where `tiles_for` says the CPU and the pool allow it."""
        t, h, g, d = q.shape
        assert q.dtype == torch.float32 and t == layout.tokens
        assert q.stride()[1:] == (g * d, d, 1), "each token's query heads contiguous"
        for buf in (pool_k, pool_v):
            assert buf.dtype == pool_k.dtype and buf.is_contiguous() and buf.device.type == "cpu"
            assert buf.shape[0] >= layout.pool_size and buf.shape[1:] == (h, d)
        b, l_cap = layout.slots.shape
        out = torch.empty((t, h, g, d), dtype=torch.float32)
        kind = _kv_kind(pool_k.dtype) | (KV_TILES if tiles else 0)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * self._extend_scratch(g, d, l_cap, kind), dtype=torch.float32)
        if self._extend(q.data_ptr(), q.stride(0), pool_k.data_ptr(), pool_v.data_ptr(), layout.slots.data_ptr(),
                        layout.q_start.data_ptr(), layout.prefix.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                        b, h, g, d, l_cap, scale, threads, window or 0, kind) != 0:
            raise ValueError(f"attention kernel: unsupported group {g} / head_dim {d} / window {window} "
                             f"(max {MAX_GROUP} / {MAX_HEAD_DIM})")
        return out

    def store_kv(self, pool_k: torch.Tensor, pool_v: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Write token t's k[t], v[t] ([T, H, D] float32, each token's heads contiguous, tokens at any
        stride) into slot loc[t] of pool_k / pool_v ([S, H, D] contiguous, one of KV_DTYPES), converted
        as memory_pool.to_kv converts (the same bits as TokenToKVPool.set_kv_buffer). loc: [T] int64,
        each below S (the caller's slots)."""
        t, h, d = k.shape
        for x in (k, v):
            assert x.dtype == torch.float32 and x.shape == (t, h, d) and x.stride()[1:] == (d, 1)
        for buf in (pool_k, pool_v):
            assert buf.dtype == pool_k.dtype and buf.is_contiguous() and buf.shape[1:] == (h, d)
        assert loc.shape == (t,) and loc.dtype == torch.int64 and loc.is_contiguous()
        if self._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), loc.data_ptr(), pool_k.data_ptr(),
                          pool_v.data_ptr(), t, h * d, _kv_kind(pool_k.dtype), torch.get_num_threads()) != 0:
            raise ValueError(f"store_kv: unsupported KV dtype {pool_k.dtype}")

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, D] in place (HF rotate-half over the first 2 * half dims of each head);
        x's heads and dims contiguous, rows at any stride. positions: [T] int64 contiguous, each below
        len(cos) (the caller checks once per pass); cos, sin: [max_position, half] contiguous."""
        t, heads, d = x.shape
        half = cos.shape[1]
        assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu"
        assert x.stride(2) == 1 and x.stride(1) == d and 2 * half <= d
        assert cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape
        assert positions.shape == (t,) and positions.dtype == torch.int64 and positions.is_contiguous()
        self._rope(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, x.stride(0), heads, d,
                   half, torch.get_num_threads())

    def moe_gemm(self, a: torch.Tensor, w: torch.Tensor, groups: list[tuple[int, int, int]],
                 out: torch.Tensor) -> None:
        """out[r] = a[r] @ w[e].T for the rows r of each group (expert e, first row, rows); other rows of
        out are left as they are. a: [S, K] (rows at any stride); w: [E, N, K]; out: [S, N] contiguous."""
        s, k = a.shape
        e, n, k2 = w.shape
        assert k == k2 and a.dtype == w.dtype == out.dtype == torch.float32 and a.device.type == "cpu"
        assert a.stride(1) == 1 and w.is_contiguous() and out.is_contiguous() and out.shape == (s, n)
        assert all(0 <= g[0] < e and 0 <= g[1] and g[1] + g[2] <= s for g in groups)
        table = torch.tensor(groups, dtype=torch.int64).reshape(-1, 3)
        self._moe_gemm(a.data_ptr(), a.stride(0), w.data_ptr(), n, k, table.data_ptr(), table.shape[0],
                       out.data_ptr(), torch.get_num_threads())

    def linear_bf16w(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T for a few rows of x: [T, K] float32 (rows at any stride), each element rounded to bf16
        first, as the bf16 GEMM does; w: [N, K] bfloat16 contiguous -> [T, N] float32 (float32 sums)."""
        t, k = x.shape
        n, k2 = w.shape
        assert k == k2 and x.dtype == torch.float32 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
        assert x.stride(1) == 1 and w.is_contiguous() and t >= 1
        out = x.new_empty(t, n)
        if self._linear_bf16(x.data_ptr(), x.stride(0), t, w.data_ptr(), n, k, out.data_ptr(),
                             torch.get_num_threads()) != 0:
            raise MemoryError(f"linear_bf16w: {t} x {k} floats for the rounded input")
        return out

    def pack_tiles(self, w: torch.Tensor) -> torch.Tensor | None:
        """w [N, K] bfloat16 contiguous -> its copy in linear_tiles' layout ([N / 16, K / 32, 16, 32] bfloat16:
        linear.c), or None where the tiles cannot take it (no AMX here, N or K not a multiple of 32)."""
        n, k = w.shape
        assert w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu"
        if not self.tiles or n % 32 or k % 32:
            return None
        wp = torch.empty(n // 16, k // 32, 16, 32, dtype=torch.bfloat16)
        if self._tiles_pack(w.data_ptr(), wp.data_ptr(), n, k, torch.get_num_threads()) != 0:
            return None
        return wp

    def linear_tiles(self, x: torch.Tensor, wp: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x @ w.T on AMX tiles, w as pack_tiles left it: x [T, K] float32 or bfloat16 (rows at any stride,
        rounded to bf16 as the bf16 GEMM rounds them) -> [T, N] in out_dtype, float32 or bfloat16: the
        float32 sums rounded to bf16 (nearest even) either way, as oneDNN's bf16 GEMM gives them."""
        t, k = x.shape
        n = wp.shape[0] * 16
        assert x.dtype in ELEMENTWISE_DTYPES and out_dtype in ELEMENTWISE_DTYPES and x.device.type == "cpu"
        assert x.stride(1) == 1 and t >= 1 and wp.shape[1] * 32 == k and wp.dtype == torch.bfloat16
        out = torch.empty(t, n, dtype=out_dtype)
        rc = self._linear_tiles(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), t, wp.data_ptr(), n, k,
                                out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"linear_tiles: {t} x {k} bf16 for the rounded input") if rc == -2 else \
                ValueError(f"linear_tiles: shape {t} x {k} x {n} or the tile state refused")
        return out

    def linear_tiles_argmax(self, x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
        """[T] int64: each row's argmax of linear_tiles(x, wp), as argmax() picks it (the first maximum of the
        bf16-rounded sums, the first NaN where there is one), without the [T, N] output (greedy decoding's
        lm_head). x, wp as linear_tiles takes them."""
        t, k = x.shape
        n = wp.shape[0] * 16
        assert x.dtype in ELEMENTWISE_DTYPES and x.device.type == "cpu"
        assert x.stride(1) == 1 and t >= 1 and wp.shape[1] * 32 == k and wp.dtype == torch.bfloat16
        out = torch.empty(t, dtype=torch.int64)
        rc = self._tiles_argmax(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), t, wp.data_ptr(), n, k,
                                out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"linear_tiles_argmax: {t} x {k} bf16 for the rounded input") if rc == -2 else \
                ValueError(f"linear_tiles_argmax: shape {t} x {k} x {n} or the tile state refused")
        return out

    def silu_mul(self, gate_up: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """gate_up: [T, 2 I] float32 or bfloat16 -> silu(gate) * up, [T, I] in `out_dtype` (float32 or
        bfloat16, rounded as .to() rounds); the arithmetic is float32 either way."""
        t, two_i = gate_up.shape
        assert gate_up.dtype in ELEMENTWISE_DTYPES and out_dtype in ELEMENTWISE_DTYPES
        assert gate_up.device.type == "cpu" and two_i % 2 == 0
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(t, two_i // 2, dtype=out_dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads(),
                       int(gate_up.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16))
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x += delta (in place; None: no add), then RMSNorm(x) * weight as a new [T, N] tensor in
        `out_dtype` (float32 or bfloat16, rounded as .to() rounds). x: [T, N] float32, delta: [T, N]
        float32 or bfloat16, rows at any stride; weight: [N] float32 contiguous."""
        t, n = x.shape
        _rows_of_heads(x)
        if delta is not None:
            _rows_of_heads(delta, ELEMENTWISE_DTYPES)
            assert delta.shape == x.shape
        assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape == (n,)
        assert out_dtype in ELEMENTWISE_DTYPES
        out = x.new_empty(t, n, dtype=out_dtype)
        self._add_norm(x.data_ptr(), x.stride(0), _ptr(delta), 0 if delta is None else delta.stride(0),
                       out.data_ptr(), weight.data_ptr(), t, n, eps, torch.get_num_threads(),
                       int(delta is not None and delta.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16))
        return out

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """torch.argmax(logits, -1) of [B, V] float32 rows (first maximum; first NaN when there is one)."""
        b, v = logits.shape
        _rows_of_heads(logits)
        out = torch.empty(b, dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.stride(0), b, v, out.data_ptr(), torch.get_num_threads())
        return out.tolist()

    def decode_stack(self, x: torch.Tensor, layers: torch.Tensor, heads: tuple[int, int, int], inter: int,
                     eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: DecodeLayout,
                     scale: float, kv_dtype: torch.dtype, gemm: object | None = None,
                     io: tuple[torch.Tensor, ...] | None = None, tiled: bool = False) -> torch.Tensor | None:
        """A whole Llama stack's decode step (csrc/decode_stack.c): every layer's norm, qkv,
        rotary, attention with the K/V store, o_proj, norm, gate_up, SiLU gate and down, with the arguments
        these wrappers pass. x: [T, N] float32 contiguous, the residual stream (updated in place); layers:
        [L, len(STACK_COLUMNS)] int64, per layer its tensors' data_ptr (0: none) and its window (0: none),
        checked by the caller (bf16 weights [out, in] and float32 norm weights, contiguous; the KV buffers as
        decode_attention takes them, in kv_dtype, at the layout's capacities); heads: (Hkv, G, D); positions,
        cos, sin as `rope` takes them (it rotates the first Hq + Hkv heads of qkv). Returns the last layer's
        MLP output, [T, N] float32.

        gemm: a STACK_GEMM that runs the linears (larger steps, on torch's packed GEMM; it keeps each output
        alive until that linear's next call), io: their inputs the stack writes, [T, N] bf16 (the norms'),
        [T, Hq D] float32 (the attention's) and [T, I] bf16 (the gate's), contiguous. Returns None then: the
        last layer's MLP output is the last down output the callback returned.

        tiled: the linears' weight columns hold their AMX tile copies (PackedLinear.tiled) and the stack runs
        linear_tiles itself; io then continues with the outputs it writes, [T, Q] float32 (qkv), [T, N] bf16
        (o_proj), [T, 2 I] bf16 (gate_up) and [T, N] bf16 (down), and the last of them is returned."""
        t, n = x.shape
        hkv, g, d = heads
        assert x.dtype == torch.float32 and x.is_contiguous() and kernel_supports(g, d)
        assert layers.dtype == torch.int64 and layers.is_contiguous() and layers.shape[1] == len(STACK_COLUMNS)
        assert len(layout.rows) == t and layout.new_pos is not None and layout.loc is not None
        assert positions.shape == (t,) and positions.dtype == torch.int64 and positions.is_contiguous()
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert sin.shape == cos.shape and 2 * cos.shape[1] <= d
        threads = torch.get_num_threads()
        p_cap = layout.p_cap if layout.entry is not None else 0
        io_ptrs = None
        assert gemm is None or not tiled  # the callback's linears, or the tile GEMM's (gemm NULL, io given)
        if gemm is not None or tiled:
            assert io is not None and len(io) == (7 if tiled else 3)
            q = hkv * g * d
            shapes = [((t, n), torch.bfloat16), ((t, q), torch.float32), ((t, inter), torch.bfloat16)]
            if tiled:
                shapes += [((t, q + 2 * hkv * d), torch.float32), ((t, n), torch.bfloat16),
                           ((t, 2 * inter), torch.bfloat16), ((t, n), torch.bfloat16)]
            for buf, (shape, dtype) in zip(io, shapes):
                assert buf.shape == shape and buf.dtype == dtype and buf.is_contiguous()
            io_ptrs = torch.tensor([buf.data_ptr() for buf in io], dtype=torch.int64)
        # With the callback or the tiles the workspace is the attention's scratch only (its size at no rows).
        own = gemm is None and not tiled
        kind = _kv_kind(kv_dtype, layout)
        ws = torch.empty(self._stack_ws(t if own else 0, n, hkv, g, d, inter, layout.l_cap, p_cap, threads, kind),
                         dtype=torch.float32)
        delta = torch.empty_like(x) if own else x  # otherwise C writes no delta: any pointer
        rc = self._stack(x.data_ptr(), delta.data_ptr(), t, layers.data_ptr(), layers.shape[0], n, hkv, g, d, inter,
                         eps, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[1],
                         layout.rows.data_ptr(), _ptr(layout.order), layout.lens.data_ptr(), layout.l_cap, scale,
                         _ptr(layout.entry), _ptr(layout.plen), p_cap, layout.new_pos.data_ptr(),
                         layout.loc.data_ptr(), kind, ws.data_ptr(), threads,
                         _NO_GEMM if gemm is None else gemm, _ptr(io_ptrs))
        if rc == STACK_GEMM_FAILED and not tiled:
            raise RuntimeError("decode stack: a linear's callback failed")
        if rc != 0:
            raise MemoryError(f"decode stack: a kernel could not allocate its rounded input at {t} rows (code {rc})")
        if tiled:
            assert io is not None
            return io[6]
        return delta if gemm is None else None


def load(cache: str | None = None) -> NativeKernels | None:
    path = build(cache=cache)
    return NativeKernels(path) if path is not None else None
