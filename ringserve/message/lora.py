"""A LoRA adapter as every service names it: tokenizer registry, scheduler load, server info."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.message.codec import fields_from_pb, fields_to_pb
from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str             # what requests pick it by (lora_path, or the OpenAI model field)
    path: str             # the PEFT directory, as the schedulers read it
    pinned: bool = False  # always resident in the schedulers' slot pools

    @classmethod
    def from_pb(cls, pb: common_pb2.LoraAdapter) -> LoraAdapter:
        return fields_from_pb(cls, pb)

    def to_pb(self) -> common_pb2.LoraAdapter:
        return fields_to_pb(self, common_pb2.LoraAdapter)
