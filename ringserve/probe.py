"""gRPC health probe for containers and the launcher: exit 0 when the service is SERVING.

    python -m ringserve.probe HOST:PORT [--service NAME] [--timeout 2]
                             [--tls-ca CA --tls-client-cert C --tls-client-key K --tls-server-name N]

TLS flags default to the RINGSERVE_TLS_* environment, so in a TLS deployment the probe, run inside
the service's container, uses the same files as the service.

Needs no extra binary (no grpc_health_probe), so the compose healthcheck and Helm exec probes use it.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.tls import TlsConfig, sync_channel, tls_from_env


def check(target: str, service: str = "", timeout: float = 2.0, tls: TlsConfig | None = None) -> bool:
    with sync_channel(target, tls) as channel:
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
    env = tls_from_env()
    for name in ("tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name"):
        ap.add_argument("--" + name.replace("_", "-"), dest=name, default=getattr(env, name))
    args = ap.parse_args(argv)
    try:
        tls = TlsConfig(tls_ca=args.tls_ca, tls_client_cert=args.tls_client_cert,
                        tls_client_key=args.tls_client_key, tls_server_name=args.tls_server_name)
    except ValueError as e:
        ap.error(str(e))
    ok = check(args.target, args.service, args.timeout, tls)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
