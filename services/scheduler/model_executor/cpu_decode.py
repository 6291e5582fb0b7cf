"""The CPU's counterpart of CUDA graphs: a decode step of a Llama stack in one native call.

At a few rows each kernel of a decode step is short (the linears stream their bf16 weights, the rest is
tiny), and the Python and torch calls between them add up to about as much again: ~250 us a layer of
module calls, checks, views and allocations, a third of a batch-1 step of SmolLM2-135M (30 layers) on
2 cores. `NativeDecodeStack.run` embeds, hands every layer to csrc/decode_stack.c, which calls the same
kernels with the same arguments in the same order as the layers do through NativeKernels, and takes
the final norm and the lm_head back in Python: the same logits, bit for bit.

Where the CPU has AMX, the linears are csrc/linear.c's tile GEMM up to TILES_MAX_T rows, which the stack
calls itself on the weights' tile copies (what PackedLinear.forward calls at those rows); without AMX,
fewer than BF16_SMALL_T rows take the native small-batch kernel, also called from C. Past those, they
are oneDNN's packed GEMMs, which only torch calls: the
stack then calls back into Python for each of them (PackedLinear.forward on the input the stack wrote, as
the layer would call it) and runs everything between them itself, four Python calls a layer instead of a
dozen module calls and their checks, views and allocations.

It is used where every piece is one the C stack has (`unsupported` says what is missing otherwise):
Llama's own layers (not a subclass's), bf16 linears without bias on the native small-batch kernel and
handing bf16 over between the C kernels (LlamaForCausalLM.use_bf16_edges), the native norms, SiLU gate
and rotary, no per-head q/k norms, no LoRA, and a decode step on the attention backend's C kernel
(`layout` set). `--disable-cuda-graph` turns it off, as it turns off the graphs on CUDA.
"""

from __future__ import annotations

from typing import cast

import torch

from services.scheduler.attention.backend import TorchSDPABackend
from services.scheduler.kernels.cpu_kernels import (
    STACK_COLUMNS,
    STACK_GEMM,
    DecodeLayout,
    NativeKernels,
    check_kv,
    prefix_dtype,
)
from services.scheduler.kernels.cpu_linear import PackedLinear
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode
from services.scheduler.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_PREFIX_K = STACK_COLUMNS.index("prefix_k")
# What decode_stack.c reads from each linear's output (in STACK_COLUMNS order): q, k and v in float32
# for rotary and attention, bf16 into the norms' residual adds and the gate (use_bf16_edges).
_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)


def unsupported(model: torch.nn.Module, backend: object, native: NativeKernels | None) -> str | None:
    """Why the stack cannot run this model on this backend (None: it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not LlamaForCausalLM"
    if native is None or not isinstance(backend, TorchSDPABackend) or backend.native is None \
            or backend.dense is None:
        return "no C attention kernels"
    if model.rotary is None or model.rotary.native is None:
        return "rotary not on the C kernels"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return "a layer that is not Llama's"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm or mlp.native is None or layer.input_layernorm.native is None \
                or layer.post_attention_layernorm.native is None:
            return "per-head q/k norms, or a norm or the gate not on the C kernels"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
                return "norm weights that are not float32"
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(lin, PackedLinear) or lin.native is None or lin.weight.dtype != torch.bfloat16 \
                    or lin.bias is not None or not lin.weight.is_contiguous():
                return "linears that are not bias-free bf16 on the native small-batch kernel"
        # decode_stack.c's larger steps hand over what use_bf16_edges makes the layers hand over
        edges = (attn.o_proj.out_bf16, mlp.gate_up_proj.out_bf16, mlp.down_proj.out_bf16, attn.qkv_proj.out_bf16,
                 layer.input_layernorm.out_dtype, layer.post_attention_layernorm.out_dtype, mlp.down_dtype)
        if edges != (True, True, True, False, attn.qkv_proj.input_dtype, mlp.gate_up_proj.input_dtype,
                     mlp.down_proj.input_dtype):
            return "linears that do not hand bf16 over to the C kernels"
    return None


class NativeDecodeStack:
    """Runs decode steps through csrc/decode_stack.c: wholly in C up to TILES_MAX_T rows where every linear
    has its AMX tile copy (else below BF16_SMALL_T rows), more with the linears called back in Python."""

    def __init__(self, model: LlamaForCausalLM, backend: TorchSDPABackend, native: NativeKernels) -> None:
        assert unsupported(model, backend, native) is None
        self.model, self.backend, self.native = model, backend, native
        first = model.first_attention()
        self.heads = (first.num_kv_heads, first.num_heads // first.num_kv_heads, first.head_dim)
        layer0 = cast(LlamaDecoderLayer, model.layers[0])
        self.inter = cast(LlamaMLP, layer0.mlp).inter
        self.eps = layer0.input_layernorm.eps
        self.scale = backend.scaling if backend.scaling is not None else first.head_dim ** -0.5
        self.windows = [w or 0 for w in backend.windows]
        # Per layer, its linears in STACK_COLUMNS order (for the callback of larger steps), and its weights
        # in that order: the parameters themselves, so that a weight update (copied in place) or anything
        # that swaps their storage is read at the next step.
        self.linears: list[tuple[PackedLinear, ...]] = []
        self.weights: list[list[torch.Tensor]] = []
        for layer in cast(list[LlamaDecoderLayer], list(model.layers)):
            attn, mlp = layer.self_attn, cast(LlamaMLP, layer.mlp)
            linears = cast(tuple[PackedLinear, ...], (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            self.linears.append(linears)
            self.weights.append([lin.weight for lin in linears] + [layer.input_layernorm.weight,
                                                                   layer.post_attention_layernorm.weight])
        tiles = [lin.tiled is not None for lins in self.linears for lin in lins]
        # Every linear on the tile GEMM (AMX, every shape a multiple of 32), or none; with some on it
        # (`mixed`), their kernels differ at every row count: a step the small-batch kernel would take a
        # part of goes through the layers, a larger one calls every linear back.
        self.tiled = all(tiles)
        self.mixed = any(tiles) and not self.tiled
        self._first = self.linears[0][0]  # with `mixed` off, every linear picks the kernel it picks
        # A larger step's state for the callback: each linear's input (in STACK_COLUMNS order: the norms'
        # output twice, the attention's, the gate's), the outputs the C side still reads, the first error.
        self._inputs: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor | None] = [None] * 4
        self._error: BaseException | None = None
        self._gemm = STACK_GEMM(self._linear)  # held here: C keeps only the pointer

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step (call after the backend's init_forward_metadata)."""
        md = self.backend.metadata
        return batch.mode == ForwardMode.DECODE and md.layout is not None and md.parts is None \
            and not (self.mixed and any(lin.kernel(len(batch.input_ids)) == "small"
                                        for lins in self.linears for lin in lins))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [B, V] float32, as LlamaForCausalLM.forward computes them (batch.greedy: maybe
        [B] int64 argmax ids instead, LlamaForCausalLM.logits)."""
        model, backend = self.model, self.backend
        layout = backend.metadata.layout
        assert layout is not None and model.rotary is not None
        x = model.embed_tokens(batch.input_ids)  # [T, H] float32, a fresh tensor: the stack adds into it
        positions = model.rotary.prepare(batch.positions)
        assert isinstance(positions, torch.Tensor)  # the native rotary's: the checked positions
        t = x.shape[0]
        # The kernel every linear takes at these rows (PackedLinear.kernel): the tile GEMM or the native
        # small-batch kernel, both called by the stack itself; else each linear is called back.
        kernel = "callback" if self.mixed else self._first.kernel(t)
        tiled, small = kernel == "tiles", kernel == "small"
        args = (x, self._table(layout, tiled), self.heads, self.inter, self.eps, positions, model.rotary.cos,
                model.rotary.sin, layout, self.scale, backend.kv_pool.dtype)
        if small:
            delta = self.native.decode_stack(*args)
        elif tiled:
            hkv, g, d = self.heads
            n, q, bf16 = x.shape[1], hkv * g * d, torch.bfloat16
            io = (torch.empty(t, n, dtype=bf16), torch.empty(t, q), torch.empty(t, self.inter, dtype=bf16),
                  torch.empty(t, q + 2 * hkv * d), torch.empty(t, n, dtype=bf16),
                  torch.empty(t, 2 * self.inter, dtype=bf16), torch.empty(t, n, dtype=bf16))
            delta = self.native.decode_stack(*args, io=io, tiled=True)
        else:
            hkv, g, d = self.heads
            h = torch.empty(t, x.shape[1], dtype=torch.bfloat16)
            self._inputs = [h, torch.empty(t, hkv * g * d), h, torch.empty(t, self.inter, dtype=torch.bfloat16)]
            self._error = None
            try:
                self.native.decode_stack(*args, gemm=self._gemm, io=(h, self._inputs[1], self._inputs[3]))
                delta = self._outputs[3]
            except RuntimeError as e:
                if self._error is not None:
                    raise self._error from e
                raise
            finally:
                self._inputs, self._outputs = [], [None] * 4
        return model.logits(x, delta, batch.greedy)

    def _linear(self, layer: int, which: int) -> int:
        """decode_stack.c's callback: layer `layer`'s linear `which` (STACK_COLUMNS' index) on its input, as
        the layer calls it; returns the output's address, kept until this linear's next call (0: it failed)."""
        try:
            y = self.linears[layer][which].forward(self._inputs[which])
            if y.dtype != _OUTPUT_DTYPES[which] or not y.is_contiguous():  # what the C side reads next
                raise RuntimeError(f"layer {layer} {STACK_COLUMNS[which]}: {y.dtype} output, the stack reads "
                                   f"{_OUTPUT_DTYPES[which]} (contiguous: {y.is_contiguous()})")
            self._outputs[which] = y
            return y.data_ptr()
        except BaseException as e:  # noqa: BLE001 - an exception cannot cross the C frames: run() raises it
            self._error = e
            return 0

    def _table(self, layout: DecodeLayout, tiled: bool = False) -> torch.Tensor:
        """[L, len(STACK_COLUMNS)] int64: this step's pointers (`tiled`: the linears' tile copies, read from
        them every step, as a weight update repacks them). The KV buffers are read from the backend every
        step (the dense rows grow; shared prefixes come and go): the first layer's are checked against the
        layout as decode_attention checks them, the others against the first layer's."""
        backend, (hkv, _, d) = self.backend, self.heads
        dense, pool = backend.dense, backend.kv_pool
        assert dense is not None
        kt0, v0 = dense.buffers(0)
        check_kv(kt0, v0, hkv, d, len(layout.lens), layout.l_cap, pool.dtype)
        shared = layout.entry is not None
        prefix0 = dense.prefix_buffers(0) if shared else None
        if prefix0 is not None:
            check_kv(prefix0[0], prefix0[1], hkv, d, layout.entries, layout.p_cap, prefix_dtype(pool.dtype))
        assert prefix0 is not None or not shared
        pk0 = pool.get_kv_buffer(0)[0]
        assert pk0.dtype == pool.dtype and pk0.is_contiguous() and pk0.shape[1:] == (hkv, d)
        rows: list[list[int]] = []
        for layer, weights in enumerate(self.weights):
            kt, v = dense.buffers(layer)
            pk, pv = pool.get_kv_buffer(layer)
            assert kt.shape == kt0.shape and v.shape == v0.shape and pk.shape == pv.shape == pk0.shape
            linears = [cast(torch.Tensor, lin.tiled) for lin in self.linears[layer]] if tiled else weights[:4]
            row = [w.data_ptr() for w in (*linears, *weights[4:])] + [kt.data_ptr(), v.data_ptr(), 0, 0,
                                                                      pk.data_ptr(), pv.data_ptr(),
                                                                      self.windows[layer]]
            if prefix0 is not None:
                prefix = dense.prefix_buffers(layer)
                assert prefix is not None and (prefix[0].shape, prefix[1].shape) == (prefix0[0].shape, prefix0[1].shape)
                row[_PREFIX_K], row[_PREFIX_K + 1] = prefix[0].data_ptr(), prefix[1].data_ptr()
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64)
