"""The launcher's command lines (the processes themselves: tests/e2e/test_launcher.py)."""

from __future__ import annotations

import os

from ringserve.config import parse_config
from ringserve.launcher import LauncherConfig, scheduler_thread_flags, service_commands


def test_scheduler_leaves_a_core_to_the_other_services() -> None:
    cores = len(os.sched_getaffinity(0))
    assert scheduler_thread_flags([], env={}) == ["--num-threads", str(max(1, cores - 1))]


def test_thread_count_from_flag_or_env_wins() -> None:
    assert scheduler_thread_flags(["--num-threads", "3"], env={}) == []
    assert scheduler_thread_flags([], env={"RINGSERVE_NUM_THREADS": "3"}) == []


def test_service_commands_start_order_and_wiring() -> None:
    cfg = parse_config(LauncherConfig, ["--model", "/m", "--scheduler-args", "--stream-interval 2"], env={})
    cmds = service_commands(cfg)
    assert [name for name, _, _ in cmds] == ["detokenizer", "scheduler", "tokenizer", "gateway"]
    sched = cmds[1][1]
    assert sched[-2:] == ["--stream-interval", "2"] and "--num-threads" in sched
    assert f"{cfg.host}:{cfg.detokenizer_port}" in sched
