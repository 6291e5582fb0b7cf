"""The launcher's command lines (the processes themselves: tests/e2e/test_launcher.py)."""

from __future__ import annotations

from ringserve.config import parse_config
from ringserve.cpu_layout import CpuLayout
from ringserve.launcher import LauncherConfig, service_commands


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
