"""gRPC health probe for containers and the launcher: exit 0 when the service is SERVING.

    python -m ringserve.probe HOST:PORT [--service NAME] [--timeout 2]

Needs no extra binary (no grpc_health_probe), so the compose healthcheck and Helm exec probes use it.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 2.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=False)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("--service", default="")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    ok = check(args.target, args.service, args.timeout)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
