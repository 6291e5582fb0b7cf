"""Read docker-compose.yml the way `docker compose` does, for the tests: `!reset`, override merge
(mappings key by key, a service's volumes by mount target), `${VAR:-default}` interpolation (nested
defaults too), depends_on order."""

from __future__ import annotations

import re
from graphlib import TopologicalSorter
from pathlib import Path
from typing import Any, cast

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
COMPOSE_TLS = ROOT / "docker-compose.tls.yml"
RING = ("detokenizer", "scheduler", "tokenizer", "gateway")


class _Reset:
    """Compose's `!reset` tag: the key is removed from the merged model."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
ComposeLoader.add_constructor("!override", lambda loader, node: (
    loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
    else loader.construct_sequence(cast(yaml.SequenceNode, node), deep=True)))


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def merge(base: Any, over: Any, key: str = "") -> Any:
    """Mappings merge key by key, volume lists by mount target, anything else is replaced, `!reset` removes."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, _Reset):
                out.pop(k, None)
            else:
                out[k] = merge(base.get(k), v, k)
        return out
    if key == "volumes" and isinstance(base, list) and isinstance(over, list):
        by_target = {volume_target(v): v for v in base}
        by_target.update({volume_target(v): v for v in over})
        return list(by_target.values())
    return over


def volume_target(volume: Any) -> str:
    """The mount path of a volume entry: `target`, or the path in `SOURCE:TARGET[:MODE]` (SOURCE may
    be an uninterpolated `${VAR:-default}`, so count from the right)."""
    if isinstance(volume, dict):
        return volume["target"]
    return next(p for p in reversed(str(volume).rsplit(":", 2)) if p.startswith("/"))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    return _interpolate(value, env)


def _interpolate(text: str, env: dict[str, str]) -> str:
    """`$$`, `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`, `${VAR?err}`, with
    defaults that nest (`${A:-${B:-c}}`), as compose does."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "{":
            end, depth = i + 2, 1  # the matching `}`, past nested `${...}`
            while depth:
                if end == len(text):
                    raise ValueError(f"unterminated ${{ in {text!r}")
                if text.startswith("${", end):
                    depth, end = depth + 1, end + 2
                    continue
                if text[end] == "}":
                    depth -= 1
                end += 1
            out.append(_expression(text[i + 2:end - 1], env))
            i = end
        elif m := _NAME.match(text, i + 1):
            out.append(env.get(m[0], ""))
            i = m.end()
        else:
            out.append("$")
            i += 1
    return "".join(out)


def _expression(expr: str, env: dict[str, str]) -> str:
    """The inside of `${...}`: NAME, then optionally an operator and an argument (itself interpolated)."""
    m = _NAME.match(expr)
    assert m, f"bad compose expression ${{{expr}}}"
    name, rest = m[0], expr[m.end():]
    val = env.get(name)
    if not rest:
        return val or ""
    op = rest[:2] if rest[:2] in (":-", ":?") else rest[:1]
    arg = rest[len(op):]
    if op == ":-":
        return val if val else _interpolate(arg, env)
    if op == "-":
        return _interpolate(arg, env) if val is None else val
    if op in (":?", "?"):
        if val is None or (op == ":?" and not val):
            raise KeyError(f"compose variable {name} is required: {_interpolate(arg, env)}")
        return val
    raise AssertionError(f"unsupported compose expression ${{{expr}}}")


def model(files: tuple[Path, ...] = (COMPOSE,), env: dict[str, str] | None = None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for f in files:
        merged = merge(merged, load(f))
    return interpolate(merged, env or {}) if env is not None else merged


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def start_order(services: dict[str, Any]) -> list[str]:
    """depends_on as a graph, in a deterministic topological order (of `services` only)."""
    graph = {name: set(svc.get("depends_on") or {}) & set(services) for name, svc in services.items()}
    ts = TopologicalSorter(graph)
    ts.prepare()
    order: list[str] = []
    while ts.is_active():
        ready = sorted(ts.get_ready())
        order.extend(ready)
        ts.done(*ready)
    return order
