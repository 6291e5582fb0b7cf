"""Build a frozen config dataclass from command-line flags and RINGSERVE_* environment variables.

Each service declares one frozen dataclass; `parse_config` turns every field into a flag
(`max_running_requests` -> `--max-running-requests`) whose default comes from the environment
(`RINGSERVE_MAX_RUNNING_REQUESTS`) and then from the dataclass. Precedence: flag > env > default.
List fields take the flag several times, or a comma-separated environment value.
Field metadata `help` documents the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "RINGSERVE_"
T = TypeVar("T", bound="DataclassInstance")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple)


def _scalar_type(tp: Any) -> Any:
    """`int | None` -> int; `tuple[str, ...]` -> str."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (list, tuple):
        return args[0] if args else str
    if args:
        return args[0]
    return tp


def _convert(raw: str, tp: Any) -> Any:
    base = _scalar_type(tp)
    if base is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return base(raw)


def _converter(tp: Any) -> Callable[[str], Any]:
    return lambda s: _convert(s, tp)


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None,
                 env: Mapping[str, str] | None = None) -> T:
    """Parse flags and environment into an instance of the frozen dataclass `cls`."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + f" [env {env_name(f.name)}]"
        if _is_list(tp):
            # SGLang's form (--lora-paths a=x b=y) and the repeated one (--scheduler a --scheduler b) alike.
            parser.add_argument(flag, dest=f.name, action="extend", nargs="+", type=_scalar_type(tp), help=help_text)
        elif _scalar_type(tp) is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_converter(tp), help=help_text)
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        given = getattr(ns, f.name)
        if given is not None:
            values[f.name] = tuple(given) if _is_list(tp) else given
            continue
        raw = env.get(env_name(f.name))
        if raw is None:
            continue
        try:
            if _is_list(tp):
                values[f.name] = tuple(_convert(p.strip(), tp) for p in raw.split(",") if p.strip())
            elif raw == "" and type(None) in typing.get_args(tp):
                values[f.name] = None
            else:
                values[f.name] = _convert(raw, tp)
        except ValueError as e:
            parser.error(f"{env_name(f.name)}: {e}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
