"""A throwaway CA and certificates for TLS tests (cryptography; EC keys: fast to generate)."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class CA:
    def __init__(self, directory: Path, name: str = "ringserve-test-ca") -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = str(directory / f"{name}.pem")
        Path(self.path).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, server: bool) -> Pair:
        """A leaf for 127.0.0.1/localhost (server) or a client identity."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pair = Pair(str(self.dir / f"{cn}.crt"), str(self.dir / f"{cn}.key"))
        Path(pair.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, Path(pair.key))
        return pair


def tls_files(directory: Path) -> Path:
    """A throwaway CA's files under the names a deployment mounts them with (ca.crt, server.crt/.key for
    127.0.0.1 and localhost, client.crt/.key); returns the directory."""
    issued = directory / "issued"
    issued.mkdir(parents=True, exist_ok=True)
    ca = CA(issued)
    shutil.copy(ca.path, directory / "ca.crt")
    for role, pair in (("server", ca.issue("server", server=True)), ("client", ca.issue("client", server=False))):
        shutil.copy(pair.cert, directory / f"{role}.crt")
        shutil.copy(pair.key, directory / f"{role}.key")
    return directory
