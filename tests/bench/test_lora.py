"""bench --lora: the random adapters it writes are ones the scheduler loads, and the flag's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import parse
from bench.lora import RANK, make_adapters
from services.scheduler.lora.adapter import HF_TARGETS, load_adapter


def test_adapters_load_on_the_model(model_dir: str, tmp_path: Path) -> None:
    made = make_adapters(Path(model_dir), 2, tmp_path)
    assert [n for n, _ in made] == ["lora0", "lora1"]
    dims = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
            "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}  # the tiny model's
    w = load_adapter("lora0", made[0][1], num_layers=4, dims=dims, allowed=frozenset(HF_TARGETS), max_rank=RANK)
    assert w.rank == RANK and w.targets == frozenset(HF_TARGETS)


def test_lora_flag_needs_the_http_targets() -> None:
    assert parse(["--lora", "4", "--targets", "gateway"]).lora == 4
    with pytest.raises(SystemExit):
        parse(["--lora", "4", "--targets", "gateway,engine"])
