"""Throwaway certificates for the local parts: a CA, the leaves it signs, kubeconfigs.

The local API server trusts the CA as ``--client-ca-file``, so a client certificate's CN is
the user name and its O entries are the groups — the cheapest way to act as several
identities (the admin, vmstream's processes, KubeVirt's service accounts). Serving
certificates for the API server and virt-api come from the same CA.
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signing only (EC keys never encipher); a CA also signs certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


class CertificateAuthority:
    """A throwaway CA: signs the serving certificate and one client certificate per user.

    The API server trusts it as ``--client-ca-file``, so a certificate's CN is the user name
    and its O entries are the groups — the cheapest way to act as several identities.
    """

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key

    @classmethod
    def create(cls, directory: Path, name: str = "vmstream-local-ca") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ca.crt").write_bytes(_pem_cert(cert))
        write_private(directory / "ca.key", _pem_key(key))
        return cls(cert, key)

    @classmethod
    def load(cls, directory: Path) -> CertificateAuthority:
        cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"unexpected CA key type in {directory}")
        return cls(cert, key)

    def issue(
        self,
        directory: Path,
        stem: str,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        server_hosts: Sequence[str] = (),
    ) -> tuple[Path, Path]:
        """Sign a leaf certificate; with ``server_hosts`` it is a serving certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.now(UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if server_hosts:
            names: list[x509.GeneralName] = []
            for host in server_hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert_path.write_bytes(_pem_cert(cert))
        write_private(key_path, _pem_key(key))
        return cert_path, key_path


def write_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """The key pair the API server signs (and checks) ServiceAccount tokens with."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "sa.key", directory / "sa.pub"
    write_private(private, _pem_key(key))
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def write_kubeconfig(
    path: Path, server: str, ca_cert: Path, cert: Path, key: Path, user: str
) -> Path:
    """A self-contained kubeconfig (data embedded), so it can be copied or read by kubectl."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "vmstream-local",
                "cluster": {"server": server, "certificate-authority-data": b64(ca_cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)},
            }
        ],
        "contexts": [
            {
                "name": f"{user}@vmstream-local",
                "context": {"cluster": "vmstream-local", "user": user},
            }
        ],
        "current-context": f"{user}@vmstream-local",
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path


__all__ = ["CertificateAuthority", "write_kubeconfig", "write_private", "write_service_account_keys"]
