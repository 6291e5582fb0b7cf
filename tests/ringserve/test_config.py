from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ringserve.config import parse_config


@dataclass(frozen=True)
class Demo:
    port: int = 1
    name: str = "a"
    ratio: float = 0.5
    verbose: bool = False
    limit: int | None = None
    peers: tuple[str, ...] = field(default=())


def test_defaults() -> None:
    assert parse_config(Demo, [], env={}) == Demo()


def test_env_then_flag_precedence() -> None:
    env = {"RINGSERVE_PORT": "7", "RINGSERVE_NAME": "env", "RINGSERVE_VERBOSE": "true",
           "RINGSERVE_PEERS": "a:1, b:2", "RINGSERVE_LIMIT": "9"}
    cfg = parse_config(Demo, ["--name", "flag"], env=env)
    assert cfg == Demo(port=7, name="flag", verbose=True, limit=9, peers=("a:1", "b:2"))


def test_repeated_flag_builds_a_list_and_overrides_env() -> None:
    cfg = parse_config(Demo, ["--peers", "x:1", "--peers", "y:2", "--no-verbose"],
                       env={"RINGSERVE_PEERS": "z:3", "RINGSERVE_VERBOSE": "1"})
    assert cfg.peers == ("x:1", "y:2") and cfg.verbose is False


def test_bad_env_value_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(Demo, [], env={"RINGSERVE_PORT": "eighty"})
    assert "RINGSERVE_PORT" in capsys.readouterr().err
