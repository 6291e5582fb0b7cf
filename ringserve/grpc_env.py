"""gRPC core settings for every ringserve process, applied before grpc is first imported: gRPC core
reads them once, when it loads (services/__init__.py and gateway/__init__.py call `apply`, so
`python -m services.<name>` and `python -m gateway` take them before any module imports grpc).

GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener: grpcio 1.85 serves TCP through its
EventEngine endpoints, which on this stack's traffic (a streamed message per decode step per hop, a
few milliseconds apart) cost more CPU per message than the endpoints gRPC used before them. A grpc.aio
client reading 64-delta messages 2 ms apart, alternating four times: 310-400 against 415-517 us per
message. The ring under bench-ring's load (SmolLM2-135M's tokenizer, the scheduler on
--synthetic-forward), four alternating pairs: 210-224 (mean 214) against 212-253 (mean 234) us of the
services' CPU per streamed token. A value already in the environment is kept.
"""

from __future__ import annotations

import os

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def apply() -> None:
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)
