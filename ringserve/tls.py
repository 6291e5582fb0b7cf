"""Optional TLS and mutual TLS for every gRPC hop (server ports and client channels).

One frozen dataclass, `TlsConfig`, holds the file paths. Service configs inherit it, so every
service takes the same flags and env (`--tls-cert` / `RINGSERVE_TLS_CERT`, ...):

    server side  --tls-cert, --tls-key      serve TLS on the gRPC port
                 --tls-ca                   ... and require a client certificate signed by this CA (mTLS)
    client side  --tls-ca                   verify the servers this process connects to (enables TLS)
                 --tls-client-cert/-key     present this certificate to them (their mTLS)
                 --tls-server-name          expected server name when it differs from the target host

One CA for the whole deployment is the usual setup, hence one `--tls-ca` for both directions.
Nothing set: plaintext, exactly as before.

A process sets its config once with `configure()`; channels and servers built without an explicit
config use it, falling back to the RINGSERVE_TLS_* environment (`tls_from_env`) so that a process
whose config class does not carry the fields yet (or a probe) still follows the deployment's TLS.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ENV = {"tls_cert": "RINGSERVE_TLS_CERT", "tls_key": "RINGSERVE_TLS_KEY", "tls_ca": "RINGSERVE_TLS_CA",
       "tls_client_cert": "RINGSERVE_TLS_CLIENT_CERT", "tls_client_key": "RINGSERVE_TLS_CLIENT_KEY",
       "tls_server_name": "RINGSERVE_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class TlsConfig:
    """TLS files for the gRPC server port and for outgoing gRPC channels (all optional)."""

    tls_cert: str | None = field(default=None, metadata={"help": "server certificate (PEM); enables TLS"})
    tls_key: str | None = field(default=None, metadata={"help": "server private key (PEM)"})
    tls_ca: str | None = field(default=None, metadata={
        "help": "CA (PEM): servers require client certs from it (mTLS); clients verify servers with it"})
    tls_client_cert: str | None = field(default=None, metadata={"help": "client certificate (PEM) for mTLS"})
    tls_client_key: str | None = field(default=None, metadata={"help": "client private key (PEM) for mTLS"})
    tls_server_name: str | None = field(default=None, metadata={
        "help": "server name to verify when it differs from the target host"})

    def __post_init__(self) -> None:
        # Fail at startup with the flag's name, not at the first handshake.
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_client_cert and not self.tls_ca:
            raise ValueError("--tls-client-cert needs --tls-ca (the CA that signed the servers)")
        for name in ENV:
            path = getattr(self, name)
            if path and name != "tls_server_name" and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file {path!r}")

    @property
    def tls(self) -> TlsConfig:
        """Just the TLS fields (service configs inherit this class and carry more)."""
        return TlsConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TlsConfig)})

    @property
    def server_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def client_enabled(self) -> bool:
        return bool(self.tls_ca)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.server_enabled:
            return None
        assert self.tls_cert and self.tls_key
        ca = _read(self.tls_ca) if self.tls_ca else None
        return grpc.ssl_server_credentials([(_read(self.tls_key), _read(self.tls_cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.client_enabled:
            return None
        assert self.tls_ca
        key = _read(self.tls_client_key) if self.tls_client_key else None
        cert = _read(self.tls_client_cert) if self.tls_client_cert else None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca), private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def tls_from_env(env: Mapping[str, str] | None = None) -> TlsConfig:
    env = os.environ if env is None else env
    return TlsConfig(**{name: env.get(var) or None for name, var in ENV.items()})


_current: TlsConfig | None = None


def configure(cfg: TlsConfig | None) -> None:
    """Set this process's TLS config (a service's config object, or its `.tls`)."""
    global _current
    _current = cfg.tls if cfg is not None else None


def current() -> TlsConfig:
    return _current if _current is not None else tls_from_env()


def sync_channel(target: str, tls: TlsConfig | None = None,
                 options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A blocking channel (probes, readiness waits) that follows the TLS config."""
    tls = tls or current()
    creds = tls.channel_credentials()
    opts = [*(options or []), *tls.channel_options()]
    if creds is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, creds, options=opts)
