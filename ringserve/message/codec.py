"""The one serializer: a flat dataclass <-> a protobuf message whose fields have the same names.

Used by the types whose fields map one to one onto their message (sampling parameters, timings,
load). proto3 `optional` fields that are unset take the dataclass default; repeated fields become
tuples. Types with nested or hot-path fields (the per-step deltas) write their own two methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")


def fields_from_pb(cls: type[T], pb: Message, **overrides: Any) -> T:
    """cls(**fields of pb); a field the message does not have keeps the dataclass default."""
    desc = pb.DESCRIPTOR.fields_by_name
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        fd = desc.get(f.name)
        if fd is None or f.name in overrides:
            continue
        if fd.is_repeated:
            kwargs[f.name] = tuple(getattr(pb, f.name))
        elif fd.has_presence and not pb.HasField(f.name):
            continue  # unset optional: the default
        else:
            kwargs[f.name] = getattr(pb, f.name)
    return cls(**kwargs, **overrides)


def fields_to_pb(obj: Any, pb_cls: type[Message], skip: tuple[str, ...] = ()) -> Any:
    """pb_cls with every field of obj that the message has; None leaves an optional field unset."""
    desc = pb_cls.DESCRIPTOR.fields_by_name
    kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
              if f.name in desc and f.name not in skip and getattr(obj, f.name) is not None}
    return pb_cls(**kwargs)
