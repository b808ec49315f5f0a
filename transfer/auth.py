"""Peer authentication for the control plane: HMAC-SHA256 over the whole handshake.

Decode signs its ``Hello`` (every field, including a fresh nonce and its send time) with the
shared secret; prefill refuses a Hello whose signature is wrong, whose clock is more than
``MAX_SKEW_S`` away, or whose nonce it has seen (a replay). Prefill signs its ``HelloAck`` together
with decode's nonce, so decode knows it paired with a holder of the secret too. Afterwards a peer
is bound to its ZMQ connection (ROUTER refuses a second connection with the same identity).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import time

SECRET_ENV = "DSA_BRIDGE_SECRET"
MAX_SKEW_S = 60.0


class AuthError(RuntimeError):
    pass


def load_secret(secret_file: str | None = None) -> bytes:
    """The shared secret from a file (first line) or the environment; b"" when neither is set."""
    if secret_file:
        with open(secret_file, "rb") as f:
            secret = f.readline().strip()
        if not secret:
            raise AuthError(f"secret file {secret_file} is empty")
        return secret
    return os.environ.get(SECRET_ENV, "").encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listener(host: str, secret: bytes, allow_insecure: bool) -> None:
    """A listener on a non-loopback address needs a shared secret, unless explicitly insecure."""
    if not secret and not allow_insecure and not is_loopback(host):
        raise AuthError(
            f"refusing to listen on non-loopback {host} without a shared secret: set "
            f"{SECRET_ENV} or --secret-file (or pass --insecure on a trusted network)")


def sign(secret: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, signature: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(sign(secret, *parts), signature)


class ReplayGuard:
    """Accepts each nonce once within the clock window."""

    def __init__(self, max_skew_s: float = MAX_SKEW_S):
        self.max_skew_s = max_skew_s
        self._seen: dict[bytes, float] = {}

    def check(self, nonce: bytes, sent_at: float) -> str | None:
        """None if fresh; otherwise why the Hello is refused."""
        now = time.time()
        self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * self.max_skew_s}
        if abs(now - sent_at) > self.max_skew_s:
            return f"clock skew of {now - sent_at:.0f}s exceeds {self.max_skew_s:.0f}s"
        if len(nonce) < 16 or nonce in self._seen:
            return "nonce reused or too short (replay?)"
        self._seen[nonce] = now
        return None
