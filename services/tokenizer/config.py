"""Configuration of the tokenizer service: one frozen dataclass, parsed from flags and RINGSERVE_* env."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from ringserve.config import parse_config
from ringserve.model_source import served_name
from ringserve.text_tokenizer import default_model
from ringserve.tls import TlsConfig

from .parsers import REASONING_PARSERS, TOOL_PARSERS

TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)

ROUTING_POLICIES = ("round_robin", "least_load", "cache_aware")


def default_tokenizer_id() -> str:
    """Unique per process: the detokenizer routes outputs by this id, so replicas must never share it."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class TokenizerConfig(TlsConfig):
    """The public InferenceService: validation, tokenization, rid_to_state, routing to schedulers.

    TLS fields (--tls-*) come from ringserve.tls.TlsConfig: the public port and both client hops.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    metrics_port: int = field(default=9091, metadata={"help": "Prometheus /metrics port; -1 disables"})
    model: str = field(default_factory=default_model, metadata={"help": "model directory or hub id"})
    scheduler: tuple[str, ...] = field(default=("127.0.0.1:50052",),
                                       metadata={"help": "scheduler address H:P (repeatable)"})
    detokenizer: tuple[str, ...] = field(default=("127.0.0.1:50053",),
                                         metadata={"help": "detokenizer address H:P (repeatable)"})
    routing_policy: str = field(default="round_robin", metadata={"help": "|".join(ROUTING_POLICIES)})
    tokenizer_id: str = field(default="", metadata={"help": "replica id (default: hostname-pid-random)"})
    served_model_name: str = field(default="", metadata={"help": "model name (default: basename of model)"})
    max_n: int = field(default=16, metadata={"help": "largest n (samples per request)"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings (and stop_regex) per request"})
    max_stop_len: int = field(default=256, metadata={"help": "longest stop string or stop_regex pattern (characters)"})
    max_top_logprobs: int = field(default=20, metadata={"help": "largest top_logprobs_num"})
    # Longer than the launcher's longest restart backoff (--max-backoff-s, 30) plus a detokenizer
    # start, so a detokenizer that keeps crashing and coming back never fails in-flight requests.
    detokenizer_grace_s: float = field(
        default=60.0, metadata={"help": "fail in-flight requests after this long without a detokenizer"})
    max_pending_requests: int = field(default=4096,
                                      metadata={"help": "most live internal requests; more get RESOURCE_EXHAUSTED"})
    cache_threshold: float = field(default=0.5, metadata={"help": "cache_aware: least prefix match ratio to follow"})
    balance_abs_threshold: int = field(default=32, metadata={"help": "cache_aware: load gap that forces least_load"})
    balance_rel_threshold: float = field(default=1.5,
                                         metadata={"help": "cache_aware: load ratio that forces least_load"})
    prefix_tree_max_tokens: int = field(default=200_000,
                                        metadata={"help": "cache_aware: tree size bound (tokens, all schedulers)"})
    drain_grace_s: float = field(default=30.0, metadata={"help": "SIGTERM: let in-flight calls finish this long"})
    chat_template: str = field(default="", metadata={"help": (
        "a chat template to use instead of the model's: a file (.jinja, or a chat_template.json) or the "
        "template text")})
    tool_call_parser: str = field(default="", metadata={"help": (
        "how tool calls are written in the output: " + "|".join(TOOL_PARSER_NAMES)
        + " (default: detected from the chat template, else hermes)")})
    reasoning_parser: str = field(default="", metadata={"help": (
        "put the model's thinking into reasoning_content: " + "|".join(REASONING_PARSER_NAMES)
        + " (default: none)")})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"--routing-policy must be one of {', '.join(ROUTING_POLICIES)}")
        if not self.scheduler:
            raise ValueError("at least one --scheduler is required")
        if not self.detokenizer:
            raise ValueError("at least one --detokenizer is required")
        if self.max_n < 1:
            raise ValueError("--max-n must be >= 1")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_NAMES)}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_NAMES)}")
        # Fill derived defaults here so every reader sees one value (the dataclass is frozen).
        if not self.tokenizer_id:
            object.__setattr__(self, "tokenizer_id", default_tokenizer_id())
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", served_name(self.model))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> TokenizerConfig:
    return parse_config(TokenizerConfig, argv, env=env)
