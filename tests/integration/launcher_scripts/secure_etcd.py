"""A real etcd on loopback with client TLS (client certificates required) and user/password auth.

Certificates are made on the fly with ``cryptography`` (a CA, a server certificate for
127.0.0.1, a client certificate, and an unrelated second CA for the wrong-CA case). Auth is set
up through etcd's own v3 JSON gateway, as an operator would with ``etcdctl``: a ``root`` user, a
job user whose role may read and write only the job prefixes it is given, then ``auth enable``.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from membership.etcd import b64, prefix_range_end
from tests.support.etcd_required import etcd_required

_ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Pki:
    """PEM files of one test PKI."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing the server uses (the wrong-CA case)."""
    cn_client_cert: Path
    """A client certificate with a CommonName (which etcd's gateway refuses with auth on)."""
    cn_client_key: Path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def make_pki(directory: Path) -> Pki:
    """Generate a CA, a server certificate for 127.0.0.1, a client certificate and a stray CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def cert_pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def name(common_name: str | None) -> x509.Name:
        if common_name is None:
            return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "elastic-run test")])
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common_name)).issuer_name(name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _ONE_DAY).not_valid_after(now + _ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(
        ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str | None,
        usages: list[x509.ObjectIdentifier],
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _ONE_DAY).not_valid_after(now + _ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]), critical=False)
        )
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("elastic-run test CA")
    # etcd's JSON gateway calls its own gRPC server presenting the server certificate, so with
    # client-cert-auth that certificate must allow client authentication too.
    server_key, server_cert = leaf(
        ca_key, ca_cert, "etcd-server-test",
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    # With auth on, the gateway refuses (HTTP 400) a client certificate that has a CommonName:
    # it could not pass the CN on as the user, so the user comes from user/password alone.
    client_key, client_cert = leaf(ca_key, ca_cert, None, [ExtendedKeyUsageOID.CLIENT_AUTH])
    cn_key, cn_cert = leaf(ca_key, ca_cert, "elastic-client-test",
                           [ExtendedKeyUsageOID.CLIENT_AUTH])
    _, other_ca = ca("some other CA")
    return Pki(
        ca=_write(directory / "ca.pem", cert_pem(ca_cert)),
        server_cert=_write(directory / "server.pem", cert_pem(server_cert)),
        server_key=_write(directory / "server-key.pem", key_pem(server_key)),
        client_cert=_write(directory / "client.pem", cert_pem(client_cert)),
        client_key=_write(directory / "client-key.pem", key_pem(client_key)),
        other_ca=_write(directory / "other-ca.pem", cert_pem(other_ca)),
        cn_client_cert=_write(directory / "cn-client.pem", cert_pem(cn_cert)),
        cn_client_key=_write(directory / "cn-client-key.pem", key_pem(cn_key)),
    )


@dataclass(frozen=True)
class SecureEtcd:
    """A running etcd with TLS and auth, and the credentials of its users."""

    server: Any
    pki: Pki
    root_password: str
    user: str
    password: str

    @property
    def endpoint(self) -> str:
        """``host:port`` of the TLS client endpoint."""
        return str(self.server.endpoint)

    @property
    def url(self) -> str:
        return f"https://{self.endpoint}"

    def client_env(self, *, password: str | None = None) -> dict[str, str]:
        """The ``ELASTIC_ETCD_*`` variables of the job user (optionally a wrong password)."""
        return {
            "ELASTIC_ETCD_CA_CERT": str(self.pki.ca),
            "ELASTIC_ETCD_CERT": str(self.pki.client_cert),
            "ELASTIC_ETCD_KEY": str(self.pki.client_key),
            "ELASTIC_ETCD_USERNAME": self.user,
            "ELASTIC_ETCD_PASSWORD": self.password if password is None else password,
        }


class _Gateway:
    """Just enough of etcd's auth API, over the v3 JSON gateway with the client certificate."""

    def __init__(self, url: str, pki: Pki) -> None:
        self.url = url
        self.session = requests.Session()
        self.session.trust_env = False
        self.session.verify = str(pki.ca)
        self.session.cert = (str(pki.client_cert), str(pki.client_key))

    def post(self, path: str, payload: dict[str, Any], token: str | None = None) -> Any:
        headers = {"Authorization": token} if token else {}
        reply = self.session.post(self.url + path, json=payload, headers=headers, timeout=10)
        assert reply.status_code == 200, f"{path}: HTTP {reply.status_code} {reply.text}"
        return reply.json()

    def close(self) -> None:
        self.session.close()


def enable_auth(
    url: str, pki: Pki, *, root_password: str, user: str, password: str,
    prefixes: Sequence[str],
) -> None:
    """Create root and ``user`` (read/write on ``prefixes`` only), then enable auth."""
    gw = _Gateway(url, pki)
    try:
        gw.post("/v3/auth/user/add", {"name": "root", "password": root_password})
        gw.post("/v3/auth/user/grant", {"user": "root", "role": "root"})
        gw.post("/v3/auth/role/add", {"name": "elastic-job"})
        for prefix in prefixes:
            gw.post("/v3/auth/role/grant", {"name": "elastic-job", "perm": {
                "permType": "READWRITE", "key": b64(prefix),
                "range_end": prefix_range_end(prefix)}})
        gw.post("/v3/auth/user/add", {"name": user, "password": password})
        gw.post("/v3/auth/user/grant", {"user": user, "role": "elastic-job"})
        gw.post("/v3/auth/enable", {})
    finally:
        gw.close()


def root_token(etcd: SecureEtcd) -> str:
    """Log in as root (for tests that inspect the keyspace behind the job's back)."""
    gw = _Gateway(etcd.url, etcd.pki)
    try:
        return str(gw.post("/v3/auth/authenticate",
                           {"name": "root", "password": etcd.root_password})["token"])
    finally:
        gw.close()


@contextmanager
def secure_etcd(tmp: Path, *, prefixes: Sequence[str], user: str = "trainer",
                password: str = "pw-Zq7fK2vX9mRt",
                extra_args: Sequence[str] = ()) -> Iterator[SecureEtcd]:
    """Start etcd with client-certificate TLS on loopback, set up auth, and stop it afterwards.

    Args:
        tmp: a directory for the certificates.
        prefixes: key prefixes the job user may read and write.
        user: the job user.
        password: the job user's password (distinctive, so tests can search logs for it).
        extra_args: further etcd flags.
    """
    from launch.etcd_server import EmbeddedEtcd, ServerTls

    pki = make_pki(tmp)
    with etcd_required():
        server = EmbeddedEtcd(tls=ServerTls(cert_file=str(pki.server_cert),
                                            key_file=str(pki.server_key),
                                            trusted_ca_file=str(pki.ca)),
                              extra_args=extra_args)
    server.start()
    try:
        etcd = SecureEtcd(server=server, pki=pki, root_password="root-Lk3pW8sN", user=user,
                          password=password)
        enable_auth(etcd.url, pki, root_password=etcd.root_password, user=user,
                    password=password, prefixes=prefixes)
        yield etcd
    finally:
        server.stop()
