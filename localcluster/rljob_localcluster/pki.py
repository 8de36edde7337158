"""A tiny PKI for the local control plane: one CA, serving certs, client certs, SA keys.

Uses the ``cryptography`` package. Keys are ECDSA P-256 for TLS (fast to make) and RSA-2048 for
the service-account signing key (what kubeadm uses; RS256 tokens are what every client expects).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = _dt.timedelta(days=365)


def _now() -> _dt.datetime:
    # Backdate a little so that clock skew between processes never makes a cert "not yet valid".
    return _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key, validity: _dt.timedelta, *, ca: bool
) -> x509.CertificateBuilder:
    """Subject, issuer, key, a random serial, ``validity`` from now, and the basic constraints and
    key usages of a CA (``ca``: may sign certificates and CRLs) or of a leaf (digital signature only)."""
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


@dataclass
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        key_path.chmod(0o600)


class CertificateAuthority:
    """A self-signed CA that signs serving and client certificates."""

    def __init__(self, common_name: str = "rljob-localcluster-ca") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._cert = (
            _builder(name, name, self._key.public_key(), _VALIDITY * 10, ca=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return _pem_cert(self._cert)

    @property
    def key_pem(self) -> bytes:
        return _pem_key(self._key)

    def _issue(
        self,
        common_name: str,
        organizations: Sequence[str],
        usages: Sequence[x509.ObjectIdentifier],
        dns_names: Iterable[str] = (),
        ips: Iterable[str] = (),
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        builder = (
            _builder(x509.Name(attrs), self._cert.subject, key.public_key(), _VALIDITY, ca=False)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dict.fromkeys(dns_names)]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in dict.fromkeys(ips)]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(_pem_cert(cert), _pem_key(key))

    def serving_cert(self, common_name: str, dns_names: Iterable[str], ips: Iterable[str]) -> KeyPair:
        return self._issue(
            common_name,
            (),
            [ExtendedKeyUsageOID.SERVER_AUTH],
            dns_names=dns_names,
            ips=ips,
        )

    def client_cert(self, user: str, groups: Sequence[str] = ()) -> KeyPair:
        """A client cert that Kubernetes maps to ``user`` (CN) in ``groups`` (O)."""
        return self._issue(user, groups, [ExtendedKeyUsageOID.CLIENT_AUTH])


def service_account_keypair() -> KeyPair:
    """RSA key pair for signing service-account tokens (public half in ``cert_pem``)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return KeyPair(pub, _pem_key(key))
