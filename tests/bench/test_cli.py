"""`python -m bench` flags."""

from __future__ import annotations

import pytest

from bench.__main__ import parse


def test_defaults_and_stream_interval() -> None:
    args = parse([])
    assert args.stream_interval == 1
    # the one command: every target, transformers generate / generate_batch included
    assert set(args.targets) == {"gateway", "native", "grpc", "engine", "vllm", "transformers", "smg"}
    assert parse(["--stream-interval", "4", "--targets", "gateway,vllm"]).stream_interval == 4


def test_unknown_target_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse(["--targets", "gateway,nope"])
