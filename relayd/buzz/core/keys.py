"""Key custody: agent secret keys encrypted at rest under a key-encryption key (KEK).

Each secret is sealed with AES-256-GCM under the KEK, with the agent's public key as associated
data, so a sealed blob cannot be swapped onto another identity. The KEK comes from a file
(``--broker-kek-file``) or the environment (``RELAYD_BROKER_KEK``), else from a 0600 file generated
in the state directory on first start. The KEK also derives the cursor MAC key. Nothing here logs
or formats key material.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEK_FILE_NAME = "broker.kek"
_VERSION = b"\x01"


class SealError(Exception):
    """A sealed key that cannot be opened (wrong KEK, tampered blob, wrong identity)."""


class KEKError(ValueError):
    """The key-encryption key cannot be loaded (message names the source, never the value)."""


class Custody:
    """Seals and opens 32-byte secrets under one KEK."""

    __slots__ = ("_aead", "_kek")

    def __init__(self, kek: bytes) -> None:
        if len(kek) != 32:
            raise KEKError("the key-encryption key must be 32 bytes")
        self._kek = kek
        self._aead = AESGCM(kek)

    def __repr__(self) -> str:
        return "<Custody>"

    def seal(self, secret: bytes, pubkey: str) -> bytes:
        """Encrypt C{secret} bound to C{pubkey}: version || nonce || ciphertext+tag."""
        nonce = os.urandom(12)
        return _VERSION + nonce + self._aead.encrypt(nonce, secret, pubkey.encode("ascii"))

    def open(self, blob: bytes, pubkey: str) -> bytes:
        """Decrypt a blob made by L{seal} for the same C{pubkey}."""
        if len(blob) < 13 or blob[:1] != _VERSION:
            raise SealError("unknown sealed key format")
        try:
            return self._aead.decrypt(blob[1:13], blob[13:], pubkey.encode("ascii"))
        except InvalidTag:
            raise SealError("sealed key does not open under this key-encryption key") from None

    def derive(self, label: bytes) -> bytes:
        """A 32-byte subkey for C{label} (domain-separated from sealing)."""
        return hmac.new(self._kek, b"relayd/buzz/" + label, hashlib.sha256).digest()


def _parse_kek_text(text: str, source: str) -> bytes:
    text = text.strip()
    try:
        kek = bytes.fromhex(text)
    except ValueError:
        raise KEKError(f"{source}: must hold 64 hex characters") from None
    if len(kek) != 32:
        raise KEKError(f"{source}: must hold 64 hex characters")
    return kek


def load_kek(state_dir: str, kek_file: str | None = None, kek_env: str | None = None) -> bytes:
    """Resolve the KEK: explicit file, then environment value, then the state dir's generated file.

    The generated file is created with mode 0600 (exclusive create, fsynced) on first start.
    """
    if kek_file:
        try:
            with open(kek_file, encoding="ascii") as f:
                return _parse_kek_text(f.read(), "--broker-kek-file")
        except OSError as e:
            raise KEKError(f"--broker-kek-file: cannot read ({e.strerror})") from None
    if kek_env:
        return _parse_kek_text(kek_env, "RELAYD_BROKER_KEK")
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, KEK_FILE_NAME)
    try:
        with open(path, encoding="ascii") as f:
            return _parse_kek_text(f.read(), path)
    except FileNotFoundError:
        pass
    kek = os.urandom(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    except FileExistsError:  # another process won the race: use its key
        with open(path, encoding="ascii") as f:
            return _parse_kek_text(f.read(), path)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(kek.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return kek
