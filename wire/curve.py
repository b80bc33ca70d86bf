"""ZeroMQ CURVE on the sockets between roles that leave the host (docs/architecture.md, "Bad messages").

A deployment has one key pair, given to every role as a secret: ``--curve-key-file`` (a ZeroMQ
certificate, as ``mmserve curve-keygen`` writes it) or ``MMSERVE_CURVE_SECRET_KEY`` (the Z85 secret
key; the public key follows from it). The engine's two ROUTER sockets are CURVE servers with it, and a
ZAP handler in the engine admits only clients that prove they hold the same key pair; API processes and
the worker connect as CURVE clients with it. A peer without the secret cannot complete the handshake, so
it can neither send the engine a message nor read one.

    API / worker (client: secret, public, server key = public) ──CURVE──▶ engine (server + ZAP)

Required for every ``tcp://`` address whose host is not loopback (``check_addresses``); used on any
``tcp://`` address when keys are given; never on ``ipc://`` (file permissions guard those).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SECRET_KEY_ENV = "MMSERVE_CURVE_SECRET_KEY"
_LOCAL_HOSTS = frozenset({"localhost", "ip6-localhost"})


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's key pair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> CurveKeys:
        secret_bytes = secret.encode() if isinstance(secret, str) else secret
        secret_bytes = secret_bytes.strip()
        try:
            public = zmq.curve_public(secret_bytes)
        except (ValueError, zmq.ZMQError) as exc:
            raise ValueError(f"not a Z85 CURVE secret key (40 characters): {exc}") from exc
        return cls(public, secret_bytes)

    @classmethod
    def from_file(cls, path: str | Path) -> CurveKeys:
        """A ZeroMQ secret certificate (public-key and secret-key lines)."""
        try:
            public, secret = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the CURVE key file {path}: {exc}") from exc
        if not secret:
            raise ValueError(f"{path} holds no secret-key: give the secret certificate, not the public one")
        keys = cls.from_secret(secret)
        if public and public != keys.public:
            raise ValueError(f"{path}: its public-key does not belong to its secret-key")
        return keys


def load_keys(key_file: str | None, secret_key: str | None) -> CurveKeys | None:
    """The key pair from a file or a secret key (the file wins), or None. ``ValueError`` names the
    problem with a key that is given but unusable."""
    if key_file:
        return CurveKeys.from_file(key_file)
    if secret_key:
        return CurveKeys.from_secret(secret_key)
    return None


def leaves_host(addr: str) -> bool:
    """True for a ``tcp://`` address whose host is not loopback (``tcp://0.0.0.0:5555``, ``tcp://engine:
    5555``, ``tcp://*:5555``); False for ``ipc://``, ``inproc://`` and loopback TCP."""
    if not addr.startswith("tcp://"):
        return False
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host.lower() in _LOCAL_HOSTS:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or a wildcard
        return True


def check_addresses(addrs: dict[str, str], keys: CurveKeys | None) -> str | None:
    """Why these sockets may not be used as configured (a start-up error), or None: an address that
    leaves the host needs keys. ``addrs``: flag name -> address."""
    if keys is not None:
        return None
    for flag, addr in addrs.items():
        if leaves_host(addr):
            return (
                f"{flag} {addr} is reachable from other hosts, and ZeroMQ traffic there must be "
                f"authenticated: give the deployment's CURVE key with --curve-key-file or {SECRET_KEY_ENV} "
                "(make one with `mmserve curve-keygen --out FILE`), or use ipc:// or a loopback address"
            )
    return None


def uses_curve(addr: str, keys: CurveKeys | None) -> bool:
    return keys is not None and addr.startswith("tcp://")


class CurveServer:
    """The engine's side: a ZAP handler on ``ctx`` admitting only the deployment's key, and the
    server options for each socket it binds. ``close`` stops the handler."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.keys = keys
        self._auth = ThreadAuthenticator(ctx, log=None)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit a client whose long-term public key is the deployment's."""
        return client_key == self.keys.public

    def secure(self, sock: zmq.Socket) -> None:
        """Before ``bind``."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Before ``connect``: the deployment's key pair, and the server's public key (the same)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


def write_key_file(path: str | Path) -> CurveKeys:
    """A new key pair as a ZeroMQ secret certificate at ``path`` (mode 0600)."""
    public, secret = zmq.curve_keypair()
    text = (
        "#   ****  mmserve's ZeroMQ CURVE secret certificate: every role of one deployment uses it  ****\n"
        "#   ****  keep it secret (a docker-compose secret, mode 0600)                               ****\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{public.decode()}"\n'
        f'    secret-key = "{secret.decode()}"\n'
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return CurveKeys(public, secret)
