"""A local certificate authority and one server certificate for the secured stack.

The secured stack encrypts every connection (Kafka ``SASL_SSL``, HTTPS for ingestion and the
registry, ``rediss://``) with a certificate this module makes with Debian's ``openssl`` the
first time the stack starts, under ``<secrets>/tls`` (0700): nothing is downloaded and
nothing is kept in the repository. One server certificate serves every process of the stack
(they all listen on loopback); its names are ``127.0.0.1`` and ``localhost``, which clients
check (librdkafka's ``ssl.endpoint.identification.algorithm=https``, Python's ``ssl``).

Files (private keys 0600, written with umask 077 so no other user ever sees them):

* ``ca.pem``: the CA's certificate, what clients trust (``ssl.ca.location``,
  ``SSL_CERT_FILE``, ``ssl_ca_certs``); ``ca.key``: its key, used only here;
* ``server.pem`` and ``server.key``: the server certificate (signed by the CA) and its key,
  for uvicorn and Redis;
* ``server.keystore.pem``: the key followed by the certificate, Kafka's PEM keystore
  (``ssl.keystore.type=PEM``).

No key is encrypted with a passphrase: a passphrase would have to be handed to every server
somehow, and the keys already sit in the stack's private secrets dir, like its passwords.
``openssl`` is given paths only, so no secret ever shows on a command line.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.process import StackError

NAMES = "subjectAltName=IP:127.0.0.1,DNS:localhost"
DAYS = 825  # what browsers and most clients still accept for a server certificate


@dataclass(frozen=True)
class TlsFiles:
    """Where the CA and the server's certificate and key are."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def keystore(self) -> Path:
        return self.root / "server.keystore.pem"

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca_cert, self.ca_key, self.server_cert,
                                         self.server_key, self.keystore))


def verify_for(env: Mapping[str, str] | None) -> ssl.SSLContext | bool:
    """What a readiness probe of a process trusts: the CA its own environment names
    (``SSL_CERT_FILE``, which its clients read too), else what this process trusts."""
    ca = (env or {}).get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_FILE")
    return ssl.create_default_context(cafile=ca) if ca else True


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise StackError("openssl was not found on PATH; install it with: apt-get install -y openssl")
    done = subprocess.run([binary, *args], capture_output=True, text=True, umask=0o077,
                          stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise StackError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def ensure_certificates(root: Path) -> TlsFiles:
    """The CA and server certificate under ``root``, made once (reused while all files exist)."""
    files = TlsFiles(root)
    if files.complete():
        return files
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    root.chmod(0o700)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(files.ca_key), "-out", str(files.ca_cert), "-days", str(DAYS),
             "-subj", "/CN=choreo secured stack local CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    request = root / "server.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(files.server_key), "-out", str(request), "-subj", "/CN=127.0.0.1")
    extensions = root / "server.ext"
    extensions.write_text(f"{NAMES}\nbasicConstraints=CA:FALSE\n"
                          "keyUsage=critical,digitalSignature,keyEncipherment\n"
                          "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(files.ca_cert), "-CAkey", str(files.ca_key),
             "-CAcreateserial", "-out", str(files.server_cert), "-days", str(DAYS),
             "-extfile", str(extensions))
    request.unlink()
    extensions.unlink()
    (root / "ca.srl").unlink(missing_ok=True)
    # Kafka's PEM keystore: the (PKCS#8, unencrypted) key, then the certificate chain
    _openssl("pkcs8", "-topk8", "-nocrypt", "-in", str(files.server_key), "-out", str(files.keystore))
    with files.keystore.open("a") as keystore:
        keystore.write(files.server_cert.read_text())
    for key in (files.ca_key, files.server_key, files.keystore):
        key.chmod(0o600)
    return files
