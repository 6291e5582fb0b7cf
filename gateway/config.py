"""The gateway's configuration: one frozen dataclass, parsed from flags and RINGSERVE_* env."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.config import parse_config
from ringserve.tls import TlsConfig

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    """'8MiB' -> 8388608; '1000' -> 1000. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 8MiB, 500kB, 1048576)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class GatewayConfig(TlsConfig):
    """HTTP gateway: OpenAI-compatible and SGLang-native routes over the tokenizer's gRPC API.

    TLS fields (--tls-*) come from ringserve.tls.TlsConfig; only the client side (--tls-ca,
    --tls-client-cert/-key, --tls-server-name) is used, for the channel to the tokenizer. HTTPS to
    clients is the ingress's job.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=30000, metadata={"help": "HTTP port (0 picks a free one)"})
    tokenizer: str = field(default="127.0.0.1:50051",
                           metadata={"help": "tokenizer InferenceService gRPC target (host:port or dns:///...)"})
    tokenizer_streams: int = field(default=2, metadata={
        "help": "long-lived GenerateStream calls that carry all generations to the tokenizer, "
                "batched per step (0: one Generate call per request)"})
    api_key: tuple[str, ...] = field(default=(), metadata={"help": "accepted API key (repeatable)"})
    api_key_file: str | None = field(default=None, metadata={"help": "file with one API key per line"})
    public_health: bool = field(default=True, metadata={"help": "serve /health* without an API key"})
    public_metrics: bool = field(default=True, metadata={"help": "serve /metrics without an API key"})
    max_body_bytes: str = field(default="8MiB", metadata={"help": "largest accepted request body"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the OpenAI API (default: the tokenizer's)"})
    startup_timeout_s: float = field(
        default=60.0, metadata={"help": "how long startup waits for the tokenizer's model info"})
    log_level: str = field(default="info", metadata={"help": "log level"})

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_size(self.max_body_bytes)  # fail at startup, not at the first request
        if self.tokenizer_streams < 0:
            raise ValueError(f"tokenizer_streams: must be >= 0, got {self.tokenizer_streams}")
        if self.api_key_file is not None and not Path(self.api_key_file).is_file():
            raise ValueError(f"api_key_file: no such file {self.api_key_file!r}")

    @property
    def max_body(self) -> int:
        return parse_size(self.max_body_bytes)

    def api_keys(self) -> tuple[str, ...]:
        """Keys from flags/env plus the key file (blank lines and # comments skipped)."""
        keys = [k for k in self.api_key if k]
        if self.api_key_file:
            for line in Path(self.api_key_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return tuple(keys)


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> GatewayConfig:
    return parse_config(GatewayConfig, argv, env=env)
