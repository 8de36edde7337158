"""Fixtures shared by every test: a real Redis server (Debian's redis-server) on a free loopback port, plain or
TLS-only (with a CA and server certificate made here by the ``cryptography`` package)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest
from portutil import free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test PKI made by :func:`_write_tls_files`."""

    ca_file: Path
    """The CA that signed the server certificate."""
    cert_file: Path
    """The server certificate, for DNS name ``localhost`` and IP address 127.0.0.1."""
    key_file: Path
    """The server certificate's private key (unencrypted)."""
    foreign_ca_file: Path
    """Another CA, which signed nothing the server uses (for wrong-CA tests)."""


@dataclass
class RedisServer:
    """A redis-server process this test session started (stopped by pid, also on failure).

    With ``tls`` set the server listens only on its TLS port ``port`` (the plain port is off).
    """

    host: str
    port: int
    password: str
    process: subprocess.Popen
    data_dir: Path
    tls: Optional[TlsFiles] = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def client(self, **kwargs):
        import redis

        if self.tls:
            kwargs = {"ssl": True, "ssl_ca_certs": str(self.tls.ca_file), **kwargs}
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def start(self) -> None:
        """(Re)start the server on the same port and data dir (for restart-recovery tests)."""
        self.process = _spawn_redis(self.port, self.password, self.data_dir, self.tls)


def _spawn_redis(port: int, password: str, data_dir: Path, tls: Optional[TlsFiles] = None) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does this)")
    listen = ["--port", str(port)]
    if tls:
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert_file),
                  "--tls-key-file", str(tls.key_file), "--tls-ca-cert-file", str(tls.ca_file),
                  "--tls-auth-clients", "no", "--logfile", str(data_dir / "redis.log")]
    proc = subprocess.Popen(
        [binary, *listen, "--bind", "127.0.0.1", "--requirepass", password, "--dir", str(data_dir),
         "--save", "", "--appendonly", "yes", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None:
                log = data_dir / "redis.log"
                tail = log.read_text()[-2000:] if tls and log.exists() else ""
                pytest.fail(f"redis-server exited with {proc.returncode}" + (f"; its log:\n{tail}" if tail else ""))
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start within 20 s")


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    """A fresh Redis with a password, per test; its append-only file survives :meth:`RedisServer.stop`."""
    yield from _redis_server()


@pytest.fixture(scope="module")
def module_redis_server() -> Iterator[RedisServer]:
    """One Redis for a module whose tests share expensive runs (module-scoped fixtures); each run sets up the keys it
    needs (FLUSHALL, then its own data)."""
    yield from _redis_server()


def _redis_server() -> Iterator[RedisServer]:
    data_dir = Path(tempfile.mkdtemp(prefix="rljob-redis-"))
    port = free_port()
    server = RedisServer("127.0.0.1", port, "test-password", _spawn_redis(port, "test-password", data_dir), data_dir)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _write_tls_files(directory: Path) -> TlsFiles:
    """Write a test PKI into ``directory``: CA → server certificate (localhost, 127.0.0.1), plus a foreign CA.

    EC P-256 keys (fast to generate), SHA-256 signatures, valid from 5 minutes ago for one day.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def sign(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write_cert(path: Path, cert: x509.Certificate) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key, foreign_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    key_file = directory / "server.key"
    key_file.write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return TlsFiles(
        ca_file=write_cert(directory / "ca.pem", sign("rljob test CA", ca_key, "rljob test CA", ca_key, ca=True)),
        cert_file=write_cert(directory / "server.pem", sign("localhost", server_key, "rljob test CA", ca_key, ca=False)),
        key_file=key_file,
        foreign_ca_file=write_cert(
            directory / "foreign-ca.pem", sign("some other CA", foreign_key, "some other CA", foreign_key, ca=True)
        ),
    )


@pytest.fixture()
def redis_tls_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh TLS-only Redis with a password, per test: ``port`` is its TLS port (no plain port), ``tls`` holds the
    CA that signed its certificate (for 127.0.0.1 and localhost); clients need not present a certificate."""
    data_dir = tmp_path / "redis-tls"
    data_dir.mkdir()
    tls = _write_tls_files(data_dir)
    port = free_port()
    server = RedisServer("127.0.0.1", port, "test-password", _spawn_redis(port, "test-password", data_dir, tls), data_dir, tls)
    try:
        yield server
    finally:
        server.stop()
