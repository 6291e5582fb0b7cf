"""Wait for a gRPC health status with Watch (the server pushes changes; nothing polls)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_status(target: str, status: int, timeout: float = 10.0) -> float:
    """Block until `target` reports `status`; return the seconds it took."""
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for resp in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True):
            if resp.status == status:
                return time.monotonic() - start
    raise TimeoutError(f"{target} never reported {status}")


def check(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
