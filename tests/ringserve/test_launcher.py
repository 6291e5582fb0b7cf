"""The launcher's command lines (the processes themselves: tests/e2e/test_launcher.py)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from ringserve import cpu_layout
from ringserve.config import parse_config
from ringserve.cpu_layout import CpuLayout
from ringserve.launcher import (
    Launcher,
    LauncherConfig,
    RestartBackoff,
    check_restart_policy,
    service_commands,
    tokenizer_grace_s,
)


def test_service_commands_start_order_and_wiring() -> None:
    cfg = parse_config(LauncherConfig, ["--model", "/m", "--scheduler-args", "--stream-interval 2"], env={})
    cmds = service_commands(cfg)
    assert [name for name, _, _ in cmds] == ["detokenizer", "scheduler", "tokenizer", "gateway"]
    sched = cmds[1][1]
    assert sched[-2:] == ["--stream-interval", "2"]
    assert f"{cfg.host}:{cfg.detokenizer_port}" in sched
    assert [target for _, _, target in cmds] == [f"{cfg.host}:{cfg.detokenizer_port}",
                                                  f"{cfg.host}:{cfg.scheduler_port}",
                                                  f"{cfg.host}:{cfg.tokenizer_port}", None]


def test_cpu_layout_gives_the_scheduler_decode_threads_before_the_users_flags() -> None:
    cfg = parse_config(LauncherConfig, ["--model", "/m", "--scheduler-args", "--decode-threads 3"], env={})
    sched = service_commands(cfg, CpuLayout(io_cpus=frozenset({1}), decode_threads=1))[1][1]
    assert sched[-4:] == ["--decode-threads", "1", "--decode-threads", "3"]  # the last one wins
    assert "--decode-threads" not in service_commands(cfg)[1][1][:-2]


@pytest.mark.parametrize("elements, pinned", [(10**6, True), (10**8, False)])
def test_launcher_sizes_the_cpu_layout_by_the_models_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                elements: int, pinned: bool) -> None:
    # Only the safetensors header is read, so a header alone stands for a model of that size.
    header = json.dumps({"w": {"dtype": "F32", "shape": [elements], "data_offsets": [0, 4 * elements]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_layout, "GPU_DEVICE_FILES", ())
    monkeypatch.delenv("RINGSERVE_DEVICE", raising=False)
    layout = Launcher(parse_config(LauncherConfig, ["--model", str(tmp_path)], env={})).layout
    assert layout == (CpuLayout(io_cpus=frozenset({1}), decode_threads=1) if pinned else None)


def test_disable_overlap_schedule_reaches_the_scheduler_only() -> None:
    cmds = {flag: service_commands(parse_config(LauncherConfig, ["--model", "/m", *flag], env={}))
            for flag in ((), ("--disable-overlap-schedule",), ("--no-disable-overlap-schedule",))}
    for flag, cmd in cmds.items():
        assert [a for a in cmd[1][1] if a.endswith("overlap-schedule")] == list(flag)  # unset: the scheduler's default
        assert [c for n, c, _ in cmd if n != "scheduler"] == [c for n, c, _ in cmds[()] if n != "scheduler"]


def test_restart_backoff_doubles_while_crashing_and_resets_after_healthy_service() -> None:
    b = RestartBackoff(first_s=1.0, max_s=30.0, reset_after_s=10.0)
    assert [b.next(0.5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]  # a crash loop
    # Kills 20 s apart, each after the service served again: back in 1 s every time (issue #31:
    # it used to keep doubling, and from the sixth the 30 s wait outlasted the tokenizer's grace).
    assert [b.next(20.0) for _ in range(6)] == [1, 1, 1, 1, 1, 1]


def test_restart_policy_flags_and_the_grace_check(caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("RINGSERVE_DETOKENIZER_GRACE_S", raising=False)
    cfg = parse_config(LauncherConfig, ["--model", "m", "--max-backoff-s", "8", "--backoff-reset-s", "5"])
    assert (cfg.restart_backoff_s, cfg.max_backoff_s, cfg.backoff_reset_s) == (1.0, 8.0, 5.0)
    assert tokenizer_grace_s(cfg) == 60.0  # the tokenizer's default, longer than the longest backoff
    check_restart_policy(LauncherConfig(model="m"))
    assert "detokenizer-grace-s" not in caplog.text
    check_restart_policy(LauncherConfig(model="m", tokenizer_args="--detokenizer-grace-s 30"))
    assert "--detokenizer-grace-s 30s is not longer than --max-backoff-s 30s" in caplog.text
    with pytest.raises(ValueError, match="--max-backoff-s"):
        LauncherConfig(model="m", restart_backoff_s=4.0, max_backoff_s=2.0)
