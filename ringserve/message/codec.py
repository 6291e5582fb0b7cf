"""The one serializer: a flat dataclass <-> a protobuf message whose fields have the same names.

Used by the types whose fields map one to one onto their message (sampling parameters, timings,
load). proto3 `optional` fields that are unset take the dataclass default; repeated fields become
tuples; map fields become tuples of (key, value) pairs sorted by key (hashable and comparable, as a
frozen dataclass wants, and the same whatever order the map iterates in). Types with nested or
hot-path fields (the per-step deltas) write their own two methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")
_PLAIN, _REPEATED, _OPTIONAL, _MAP = 0, 1, 2, 3
_SHARED: dict[tuple[type, type[Message]], tuple[tuple[str, int], ...]] = {}


def _shared_fields(cls: type, pb_cls: type[Message]) -> tuple[tuple[str, int], ...]:
    """(name, kind) of each dataclass field the message also has, worked out once per pair: the
    conversions run per request (sampling parameters, timings), and looking the descriptors up on
    every call cost more than the copying."""
    shared = _SHARED.get((cls, pb_cls))
    if shared is None:
        out: list[tuple[str, int]] = []
        for f in dataclasses.fields(cls):
            fd = pb_cls.DESCRIPTOR.fields_by_name.get(f.name)
            if fd is None:
                continue
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                out.append((f.name, _MAP))
            else:
                out.append((f.name, _REPEATED if fd.is_repeated else _OPTIONAL if fd.has_presence else _PLAIN))
        shared = _SHARED[(cls, pb_cls)] = tuple(out)
    return shared


def fields_from_pb(cls: type[T], pb: Message) -> T:
    """cls(**fields of pb); a field the message does not have keeps the dataclass default."""
    kwargs: dict[str, Any] = {}
    for name, kind in _shared_fields(cls, type(pb)):
        if kind == _REPEATED:
            kwargs[name] = tuple(getattr(pb, name))
        elif kind == _MAP:
            kwargs[name] = tuple(sorted(getattr(pb, name).items()))
        elif kind == _PLAIN or pb.HasField(name):  # an unset optional keeps the default
            kwargs[name] = getattr(pb, name)
    return cls(**kwargs)


def fields_to_pb(obj: Any, pb_cls: type[Message]) -> Any:
    """pb_cls with every field of obj that the message has; None leaves an optional field unset."""
    kwargs: dict[str, Any] = {}
    for name, kind in _shared_fields(type(obj), pb_cls):
        value = getattr(obj, name)
        if value is not None:
            kwargs[name] = dict(value) if kind == _MAP else value
    return pb_cls(**kwargs)
