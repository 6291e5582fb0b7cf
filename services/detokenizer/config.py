"""DetokenizerConfig: flags and RINGSERVE_* environment, parsed by ringserve.config.parse_config."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.text_tokenizer import default_model
from ringserve.tls import TlsConfig


@dataclass(frozen=True)
class DetokenizerConfig(TlsConfig):
    """Detokenizer service: token ids from schedulers in, text deltas to tokenizer replicas out.

    TLS fields (--tls-*) come from ringserve.tls.TlsConfig (it only serves: no client hop).
    """

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50053, metadata={"help": "gRPC port"})
    metrics_port: int = field(default=9093, metadata={"help": "Prometheus /metrics port; -1 disables"})
    model: str = field(default_factory=default_model, metadata={"help": "model directory or hub id"})
    max_tracked_requests: int = field(default=65536, metadata={
        "help": "most requests with decode state at once; deltas of new requests beyond it are dropped"})
    subscriber_queue: int = field(default=256, metadata={
        "help": "step batches queued per subscriber before Push waits (backpressure)"})
    backlog: int = field(default=1024, metadata={
        "help": "step batches kept per owner with no subscriber before dropping (resync recovers)"})
    grace_s: float = field(default=10.0, metadata={"help": "SIGTERM drain grace period, seconds"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_tracked_requests", "subscriber_queue", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
