"""The launcher's command lines (the processes themselves: tests/e2e/test_launcher.py)."""

from __future__ import annotations

from ringserve.config import parse_config
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
