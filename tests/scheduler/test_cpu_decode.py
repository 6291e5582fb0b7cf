"""The one-call native decode stack (model_executor/cpu_decode.py): the same logits, bit for bit, as the
Python layers, and only where it has every piece of the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.kernels import cpu_kernels, cpu_linear
from services.scheduler.model_executor import cpu_decode
from services.scheduler.model_executor.forward_batch import ForwardMode
from services.scheduler.model_executor.model_runner import ModelRunner
from tests.scheduler.test_decode_cache import sharing
from tests.scheduler.test_model_runner import Seq, make_batch


def bf16_runners(path: str) -> tuple[ModelRunner, ModelRunner]:
    """Two bf16 runners of one model: the first with the stack, the second without."""
    if not cpu_linear.supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    on, off = (ModelRunner(path, device="cpu", dtype="bfloat16", max_total_tokens=2048, max_running_requests=16,
                           disable_cuda_graph=disable) for disable in (False, True))
    if on.native is None:
        pytest.skip("no C compiler: the stack is the C kernels'")
    assert on.decode_stack is not None and off.decode_stack is None
    return on, off


def counted(runner: ModelRunner) -> list[tuple[int, bool]]:
    """Each step the runner's stack ran: its rows, and whether some read a shared prefix."""
    stack = runner.decode_stack
    assert stack is not None
    ran: list[tuple[int, bool]] = []
    run = stack.run

    def spy(batch):  # type: ignore[no-untyped-def]
        layout = runner.attn_backend.metadata.layout
        ran.append((len(batch.input_ids), layout is not None and layout.entry is not None))
        return run(batch)

    stack.run = spy  # type: ignore[method-assign]
    return ran


def no_tile_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The linears as on a CPU without AMX: no tile copy of any weight (the runners built after this)."""
    monkeypatch.setattr(cpu_kernels.NativeKernels, "pack_tiles", lambda self, w: None)


@pytest.mark.parametrize("amx", [True, False], ids=["tile-gemm", "no-tiles"])
def test_decode_steps_give_the_layers_logits_bit_for_bit(model_dir: str, amx: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, then decode at 7, 3, 1, 9, 12, 5 and 8 rows. Where the CPU has AMX every step's linears are
    the tile GEMM, called by the stack itself (the tiny model's shapes are multiples of 32); without the tile
    copies (as on a CPU without AMX) the steps below BF16_SMALL_T rows run the native small-batch kernel
    inside the stack, the others the packed GEMMs called back in Python."""
    assert cpu_linear.BF16_SMALL_T == 8  # the row counts below straddle it
    if not amx:
        no_tile_copies(monkeypatch)
    runners = bf16_runners(model_dir)
    ran = counted(runners[0])
    native = runners[0].native
    assert native is not None
    if amx and not native.tiles:
        pytest.skip("no AMX tiles on this machine")
    modes: list[bool] = []
    stack_call = native.decode_stack

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        modes.append(bool(kwargs.get("tiled")))
        return stack_call(*args, **kwargs)

    native.decode_stack = spy  # type: ignore[method-assign]
    got: list[list[torch.Tensor]] = [[], []]
    steps = (7, 3, 1, 9, 12, 5, 8)
    for out, r in zip(got, runners):
        seqs = [Seq(r, [(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)]) for i in range(12)]
        out.append(r.forward(make_batch(seqs, ForwardMode.EXTEND, [len(s.ids) for s in seqs])))
        for step, rows in enumerate(steps):
            for s in seqs[:rows]:
                s.ids.append(11 + step)
            out.append(r.forward(make_batch(seqs[:rows], ForwardMode.DECODE, [1] * rows)))
    assert ran == [(rows, False) for rows in steps]
    assert modes == [amx] * len(steps)
    for a, b in zip(*got):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_some_linears_on_tiles_leave_the_small_steps_to_the_layers(model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Tile copies of some weights only (a shape the tiles do not take): below BF16_SMALL_T rows no one
    kernel takes every linear, so those steps go through the layers; larger ones through the stack, the
    linears called back. The logits are the layers' either way."""
    pack = cpu_kernels.NativeKernels.pack_tiles
    monkeypatch.setattr(cpu_kernels.NativeKernels, "pack_tiles",
                        lambda self, w: None if w.shape[0] == w.shape[1] else pack(self, w))  # o_proj
    runners = bf16_runners(model_dir)
    native, stack = runners[0].native, runners[0].decode_stack
    assert native is not None and stack is not None
    if not native.tiles:
        pytest.skip("no AMX tiles on this machine")
    assert stack.mixed and not stack.tiled
    ran = counted(runners[0])
    got: list[list[torch.Tensor]] = [[], []]
    for out, r in zip(got, runners):
        seqs = [Seq(r, [(3 * i + j) % 200 + 1 for j in range(3 + i)]) for i in range(9)]
        r.forward(make_batch(seqs, ForwardMode.EXTEND, [len(s.ids) for s in seqs]))
        for step, rows in enumerate((3, 9)):
            for s in seqs[:rows]:
                s.ids.append(31 + step)
            out.append(r.forward(make_batch(seqs[:rows], ForwardMode.DECODE, [1] * rows)))
    assert ran == [(9, False)]
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_a_greedy_step_gives_its_logits_argmax(model_dir: str) -> None:
    """ForwardBatch.greedy: where the CPU has AMX, the stack returns each row's argmax ids (the lm_head fused
    with it, no logits), at any row count; elsewhere the logits. Either way the ids the greedy sampler takes
    from the other runner's logits, step by step as the requests' own greedy tokens feed back."""
    runners = bf16_runners(model_dir)
    native = runners[0].native
    assert native is not None
    ids: list[list[list[int]]] = [[], []]
    kinds: list[int] = []
    for got, r in zip(ids, runners):
        seqs = [Seq(r, [(5 * i + j) % 200 + 1 for j in range(4 + 2 * i)]) for i in range(12)]
        r.forward(make_batch(seqs, ForwardMode.EXTEND, [len(s.ids) for s in seqs]))
        for rows in (9, 12, 3, 8):
            last = got[-1] if got else []
            for i, s in enumerate(seqs[:rows]):
                s.ids.append(last[i] if i < len(last) else 7)  # its greedy token, where it ran last step
            batch = make_batch(seqs[:rows], ForwardMode.DECODE, [1] * rows)
            batch.greedy = r is runners[0]
            out = r.forward(batch)
            if r is runners[0]:
                kinds.append(out.dim())
            got.append(out.tolist() if out.dim() == 1 else native.argmax(out))
    assert ids[0] == ids[1]
    assert kinds == [1 if native.tiles else 2] * 4


def test_a_failing_linear_in_a_larger_step_raises_its_error(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback cannot raise through the C frames: the step raises the linear's own exception (the
    callback's path: without the tile copies, as on a CPU without AMX)."""
    no_tile_copies(monkeypatch)
    on, _ = bf16_runners(model_dir)
    seqs = [Seq(on, [i + 1, i + 2, i + 3]) for i in range(8)]
    on.forward(make_batch(seqs, ForwardMode.EXTEND, [3] * 8))
    for s in seqs:
        s.ids.append(5)
    down = on.model.get_submodule("layers.1.mlp.down_proj")

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("down_proj broke")

    down.forward = broken  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="down_proj broke"):
        on.forward(make_batch(seqs, ForwardMode.DECODE, [1] * 8))
    # A linear that hands over another dtype than the C side reads: an error, never a misread buffer.
    down.forward = lambda x: torch.zeros(8, on.model.config.hidden_size)  # float32
    for s in seqs:
        s.ids.append(6)
    with pytest.raises(RuntimeError, match="down: torch.float32 output, the stack reads torch.bfloat16"):
        on.forward(make_batch(seqs, ForwardMode.DECODE, [1] * 8))


def test_rows_on_a_shared_prefix_and_a_sliding_window(model_dir: str, tmp_path: Path) -> None:
    """Mistral with a window of 16 on every layer, followers reading their leader's prompt from one
    shared copy: the layout's prefix entries and each layer's window go through the stack as well."""
    from tests.random_models import build_windowed

    runners = bf16_runners(str(build_windowed("mistral", tmp_path / "mistral", model_dir)))
    ran = counted(runners[0])
    got: list[list[torch.Tensor]] = [[], []]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (100, 90, 6, 9, 3, 4, 5, 7, 8)]
    for out, r in zip(got, runners):
        leader, loner = Seq(r, prompts[0]), Seq(r, prompts[1])
        out.append(r.forward(make_batch([leader, loner], ForwardMode.EXTEND, [100, 90])))
        seqs = [leader, loner] + [sharing(r, leader, 80, own) for own in prompts[2:]]
        for step, active in enumerate(([0, 1, 2, 3], [3, 1, 0], [1], [8, 1, 2, 3, 4, 5, 6, 7, 0])):
            for i in active:
                seqs[i].ids.append(21 + step)
            out.append(r.forward(make_batch([seqs[i] for i in active], ForwardMode.DECODE, [1] * len(active))))
    assert ran == [(4, True), (3, True), (1, False), (9, True)]
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_it_runs_only_where_it_has_every_piece(model_dir: str) -> None:
    f32 = ModelRunner(model_dir, device="cpu", max_total_tokens=512, max_running_requests=4)
    assert f32.decode_stack is None  # float32 linears: small batches go to F.linear, not a C kernel
    assert "linears" in (cpu_decode.unsupported(f32.model, f32.attn_backend, f32.native) or "")
    if f32.native is None:
        pytest.skip("no C compiler")
    bf16 = ModelRunner(model_dir, device="cpu", dtype="bfloat16", max_total_tokens=512, max_running_requests=4)
    assert cpu_decode.unsupported(bf16.model, bf16.attn_backend, None) == "no C attention kernels"
    bf16.model.first_attention().o_proj.bias = torch.nn.Parameter(torch.zeros(bf16.model.config.hidden_size))
    assert "bias-free" in (cpu_decode.unsupported(bf16.model, bf16.attn_backend, bf16.native) or "")
