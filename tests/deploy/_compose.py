"""Read docker-compose.yml the way `docker compose` does, for the tests: `!reset`, override merge
(mappings key by key, a service's volumes by mount target), `${VAR:-default}` interpolation,
depends_on order."""

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


_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        name = m["name"] or m["bare"]
        op, arg, val = m["op"], m["arg"] or "", env.get(name)
        if op == ":-":
            return val if val else arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?") and (val is None or (op == ":?" and not val)):
            raise KeyError(f"compose variable {name} is required: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


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
    """depends_on as a graph, in a deterministic topological order."""
    graph = {name: set(svc.get("depends_on") or {}) for name, svc in services.items()}
    ts = TopologicalSorter(graph)
    ts.prepare()
    order: list[str] = []
    while ts.is_active():
        ready = sorted(ts.get_ready())
        order.extend(ready)
        ts.done(*ready)
    return order
