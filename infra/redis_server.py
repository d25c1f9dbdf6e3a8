"""Redis 7 from Debian's ``redis-server``, with append-only persistence for the local stack.

ACL mode (off by default): when the URL names a user other than ``default``
(``redis://package:secret@127.0.0.1:6379/0``) or users are given, Redis starts with an ACL
file written into its private work dir (0600) in which each user may run every command but
the ``@admin`` and ``@dangerous`` categories, on the key patterns given for it (``keys``:
prefixes, each allowing ``<prefix>`` and ``<prefix>:*``; every key when none is given), and
on no pub/sub channel; the ``default`` user is switched off, so a connection without
credentials, or with a wrong password, is refused. A password never goes on the command
line: ``requirepass`` (a URL with a password and no user) is written to a private config file.

TLS mode (``tls=TlsFiles``, off by default; the secured stack's Redis): the port given
speaks TLS only (``tls-port``, and ``port 0``: no plain listener), with the server
certificate and key and the CA of ``infra.tls``; clients are not asked for certificates
(``tls-auth-clients no``: they log in as their ACL user). These settings go into a private
config file, not on the command line. Clients use ``rediss://...?ssl_ca_certs=<ca.pem>``,
which redis-py reads from the URL.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

import redis

from infra.process import ManagedProcess
from infra.security import write_private
from infra.tls import TlsFiles


INSTALL_HINT = "Install it with: apt-get install -y redis-server (bash infra/setup.sh does this)."
# what a user may run: its scripts (EVALSHA/SCRIPT LOAD), hashes, sorted sets, ... (on its keys)
COMMAND_RULES = "+@all -@admin -@dangerous"


def key_rules(prefixes: Sequence[str]) -> str:
    """``~p ~p:*`` for each prefix (``*``: every key); Redis checks them on every command,
    inside scripts too, and on the keys a script declares."""
    if any(not p or any(c.isspace() or c in "?[]\\" for c in p) for p in prefixes):
        raise ValueError(f"invalid Redis key prefixes {list(prefixes)!r}")
    if "*" in prefixes:
        return "~*"
    return " ".join(f"~{p} ~{p}:*" for p in prefixes)


def acl_file_text(users: Mapping[str, str], keys: Mapping[str, Sequence[str]] | None = None) -> str:
    """An ACL file: ``default`` off, each user on with its password (stored as SHA-256),
    limited to its key prefixes (every key for a user ``keys`` does not name)."""
    lines = ["user default off resetpass -@all"]
    for name, password in sorted(users.items()):
        if not name or any(c.isspace() for c in name) or name == "default":
            raise ValueError(f"invalid Redis ACL user name {name!r}")
        if not password:
            raise ValueError(f"Redis ACL user {name} needs a password")
        digest = hashlib.sha256(password.encode()).hexdigest()
        scope = key_rules((keys or {}).get(name, ["*"]))
        lines.append(f"user {name} on resetpass #{digest} resetkeys resetchannels {scope} {COMMAND_RULES}")
    return "\n".join(lines) + "\n"


def redis_process(url: str, data_dir: Path, users: Mapping[str, str] | None = None,
                  name: str = "redis", extra_args: Sequence[str] = (),
                  keys: Mapping[str, Sequence[str]] | None = None,
                  tls: TlsFiles | None = None) -> ManagedProcess:
    """Redis for ``url``, with its files under ``data_dir/<name>``.

    ACL mode when the URL names a user other than ``default`` or ``users`` is given (see the
    module doc); otherwise exactly the local stack's Redis (``requirepass`` if the URL has a
    password). TLS only on the URL's port when ``tls`` is given.

    The binary is looked up lazily (start raises a clear sentence when it is missing), so that
    status and stop work on a machine without it.
    """
    parsed = urlparse(url)
    host = parsed.hostname or "127.0.0.1"
    port = parsed.port or 6379
    binary = shutil.which("redis-server") or "redis-server"
    workdir = data_dir / name
    argv = [
        binary,
        "--bind", host,
        *(["--port", str(port)] if tls is None else []),  # TLS: the port is in tls.conf
        "--dir", str(workdir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "no",
        # a delivery's hashes (state, dedupe and effect answers) hold values up to ~130 bytes (a
        # step's record, a fan-in decision); past the limit (default 64) a hash leaves the compact
        # listpack encoding and costs ~45-65 % more (980 vs 600 bytes for a delivery's step table)
        "--hash-max-listpack-value", "192",
    ]
    argv += extra_args  # e.g. a cluster node's settings (infra.redis_cluster)
    password = unquote(parsed.password) if parsed.password else None  # redis-py unquotes too
    username = unquote(parsed.username) if parsed.username else None
    acl_users = dict(users or {})
    if username and username != "default":
        acl_users.setdefault(username, password or "")
    if acl_users:
        acl_file = workdir / "users.acl"
        write_private(acl_file, acl_file_text(acl_users, keys))
        argv += ["--aclfile", str(acl_file)]
    config: list[str] = []  # one private config file, which must be the first argument
    if not acl_users and password:
        config.append(f'requirepass "{password}"')
    if tls is not None:
        config += ["port 0", f"tls-port {port}", f'tls-cert-file "{tls.server_cert}"',
                   f'tls-key-file "{tls.server_key}"', f'tls-ca-cert-file "{tls.ca_cert}"',
                   "tls-auth-clients no"]
    if config:
        config_file = workdir / ("tls.conf" if tls is not None else "auth.conf")
        write_private(config_file, "".join(f"{line}\n" for line in config))
        argv.insert(1, str(config_file))

    def ready() -> bool:
        with redis.Redis.from_url(url, socket_timeout=1) as client:
            return bool(client.ping())

    return ManagedProcess(
        name=name, argv=argv, workdir=workdir, ports=[(host, port)], ready=ready,
        # Redis rewrites its title to "redis-server <host>:<port>", which is what stays visible
        marker=f"{host}:{port}",
        install_hint=INSTALL_HINT,
    )
