"""Certificates and kubeconfig for the local control plane.

One CA signs the apiserver's serving certificate and an `admin` client certificate in
`system:masters`; a separate key pair signs service-account tokens. ECDSA P-256 keeps
generation instant, and a short validity is fine because every cluster is throwaway.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=7)


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path: return self.dir / "ca.crt"
    @property
    def ca_key(self) -> Path: return self.dir / "ca.key"
    @property
    def serving_crt(self) -> Path: return self.dir / "apiserver.crt"
    @property
    def serving_key(self) -> Path: return self.dir / "apiserver.key"
    @property
    def admin_crt(self) -> Path: return self.dir / "admin.crt"
    @property
    def admin_key(self) -> Path: return self.dir / "admin.key"
    @property
    def sa_key(self) -> Path: return self.dir / "sa.key"
    @property
    def sa_pub(self) -> Path: return self.dir / "sa.pub"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


def generate(directory: Path, hosts: list[str]) -> Pki:
    """Write a fresh PKI into `directory`; `hosts` are the serving cert's SANs."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)

    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hicache-local-ca")])
    ca = (_builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_crt, ca)

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    serving_key = _key()
    serving = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
                        ca_name, serving_key.public_key())
               .add_extension(x509.SubjectAlternativeName(sans), critical=False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
               .sign(ca_key, hashes.SHA256()))
    _write_key(pki.serving_key, serving_key)
    _write_cert(pki.serving_crt, serving)

    admin_key = _key()
    admin = (_builder(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, "admin")]),
                      ca_name, admin_key.public_key())
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
             .sign(ca_key, hashes.SHA256()))
    _write_key(pki.admin_key, admin_key)
    _write_cert(pki.admin_crt, admin)

    sa_key = _key()
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki


def write_kubeconfig(path: Path, pki: Pki, server: str, *, user: str = "admin",
                     client_crt: Path | None = None, client_key: Path | None = None,
                     token: str | None = None) -> Path:
    """A kubeconfig that references the PKI files by path (kopf, kubectl and helm all accept that)."""
    creds: dict = {"token": token} if token else {
        "client-certificate": str(client_crt or pki.admin_crt),
        "client-key": str(client_key or pki.admin_key)}
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": server,
                                                   "certificate-authority": str(pki.ca_crt)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user,
                                                   "namespace": "default"}}],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)
    return path
