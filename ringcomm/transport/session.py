"""The job token on the wire: derived, fresh per connection, and never sent (pure; no sockets).

- :func:`mint_token`: a fresh secret, for a group nobody gave one (the store's host mints it).
- Data plane logins (``handshake``: ZMTP PLAIN with a per-connection nonce and an HMAC over
  the receiver's salt; :class:`LoginCheck` admits each nonce once) and ``curve`` key pairs
  derived from the token.
- Store sessions (:class:`SessionKeys`): a key per client nonce; every later request and
  reply carries an HMAC of its bytes under it, request ids increasing.
- Handing out a minted token (:func:`dh_keypair`, :func:`seal`): Diffie-Hellman on first
  contact, unauthenticated, so who may receive it is the store's policy (store.py).

Invariant: a login or request seen on the network and replayed fails. Derivations in full:
docs/architecture.md, section "transport/session.py".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = [
    "MAC_BYTES",
    "NONCE_BYTES",
    "LoginCheck",
    "SessionKeys",
    "dh_keypair",
    "dh_shared",
    "job_key",
    "mac",
    "mint_token",
    "plain_login",
    "seal",
]

NONCE_BYTES = 16
MAC_BYTES = 32
_LABEL = b"ringcomm v2: "
#: RFC 3526, 2048-bit MODP group 14 (generator 2).
_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A0879"
    "8E3404DDEF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B"
    "0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA4836"
    "1C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804"
    "F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6"
    "955817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
_DH_BYTES = 256
_DH_EXPONENT_BITS = 256


def mint_token() -> str:
    """A fresh job token (256 random bits, hex)."""
    return secrets.token_hex(32)


def job_key(token: str, purpose: bytes) -> bytes:
    """The key for one purpose (``b"plain"``, ``b"store"``, ...) derived from ``token``."""
    return hmac.new(token.encode(), _LABEL + purpose, hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenation of ``parts`` (each length-prefixed: unambiguous)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


# -- the data plane's PLAIN login -----------------------------------------------------------
def plain_login(plain_key: bytes, salt: bytes, src: int) -> tuple[bytes, bytes]:
    """``(username, password)`` for one connection of rank ``src`` to the receiver whose
    salt is ``salt``; ``plain_key`` is ``job_key(token, b"plain")``. A fresh nonce each call."""
    username = b"r%d.%s" % (src, os.urandom(NONCE_BYTES).hex().encode())
    return username, mac(plain_key, salt, username).hex().encode()


class LoginCheck:
    """A receiver's side of :func:`plain_login`: its salt and the nonces already used."""

    def __init__(self, plain_key: bytes, salt: bytes | None = None) -> None:
        self._key = plain_key
        self.salt = os.urandom(NONCE_BYTES) if salt is None else salt
        self._used: set[bytes] = set()

    def check(self, username: bytes, password: bytes) -> int | None:
        """The sender's rank if the login is right and its nonce new, else None."""
        name, dot, nonce = username.partition(b".")
        if not dot or not name.startswith(b"r") or not name[1:].isdigit():
            return None
        if len(nonce) != 2 * NONCE_BYTES or len(password) != 2 * MAC_BYTES:
            return None
        expected = mac(self._key, self.salt, username).hex().encode()
        if not hmac.compare_digest(expected, password) or nonce in self._used:
            return None
        self._used.add(nonce)
        return int(name[1:])


# -- store sessions ------------------------------------------------------------------------
class SessionKeys:
    """The server's side of store sessions: a random secret, no state per hello."""

    def __init__(self, token: str) -> None:
        self._key = job_key(token, b"store")
        self._secret = os.urandom(32)

    def server_nonce(self, cn: bytes) -> bytes:
        return hmac.new(self._secret, cn, hashlib.sha256).digest()[:NONCE_BYTES]

    def key(self, cn: bytes) -> bytes:
        """The session key of client nonce ``cn``."""
        return session_key(self._key, cn, self.server_nonce(cn))


def session_key(store_key: bytes, cn: bytes, sn: bytes) -> bytes:
    """The key of the session with nonces ``cn``, ``sn``; ``store_key`` is
    ``job_key(token, b"store")``."""
    return mac(store_key, b"session", cn, sn)


# -- handing out a minted token ------------------------------------------------------------
def dh_keypair() -> tuple[int, bytes]:
    """A fresh Diffie-Hellman secret and its public value (256 bytes)."""
    x = secrets.randbits(_DH_EXPONENT_BITS) | (1 << (_DH_EXPONENT_BITS - 1))
    return x, pow(2, x, _P).to_bytes(_DH_BYTES, "big")


def dh_shared(secret: int, peer_public: bytes) -> bytes | None:
    """The shared secret with ``peer_public`` (hashed), or None when it is not a valid
    public value."""
    if len(peer_public) != _DH_BYTES:
        return None
    y = int.from_bytes(peer_public, "big")
    if not 1 < y < _P - 1:
        return None
    return hashlib.sha256(pow(y, secret, _P).to_bytes(_DH_BYTES, "big")).digest()


def seal(shared: bytes, cn: bytes, sn: bytes, data: bytes) -> bytes:
    """``data`` XOR a key stream from the shared secret and both nonces (its own inverse).
    Integrity comes from the session proof that goes with it (store.py)."""
    stream = hashlib.shake_256(_LABEL + b"seal" + shared + cn + sn).digest(len(data))
    return bytes(a ^ b for a, b in zip(data, stream, strict=True))
