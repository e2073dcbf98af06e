"""Nostr primitives the broker needs: NIP-01 ids, BIP-340 signing, NIP-10 thread tags, NIP-AE d-tags.

Pure (no I/O). The one source of randomness is BIP-340's auxiliary nonce randomness, which coincurve
draws from the OS when signing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, Iterable, Sequence

from coincurve import PrivateKey, PublicKey, PublicKeyXOnly

from relayd.base import jsoncodec

try:  # coincurve's own cffi binding: sign with a keypair built once per key, not once per event
    from coincurve._libsecp256k1 import ffi as _ffi
    from coincurve._libsecp256k1 import lib as _lib
    from coincurve.context import GLOBAL_CONTEXT as _CONTEXT

    _LOW_LEVEL = hasattr(_lib, "secp256k1_schnorrsig_sign32") and hasattr(_lib, "secp256k1_keypair_create")
except ImportError:  # pragma: no cover - another coincurve layout: the public API still works
    _LOW_LEVEL = False

KIND_PROFILE = 0
KIND_DELETION = 5
KIND_REACTION = 7
KIND_CHANNEL_MESSAGE = 9
KIND_AUTH = 22242
KIND_ENGRAM = 30174
KIND_MANAGED_AGENT = 30177

Event = dict[str, Any]

_DTAG_LABEL = b"agent-memory/v1/d-tag"
# NIP-01's serialisation: compact, UTF-8, non-ASCII verbatim; a lone surrogate has no UTF-8 form to hash.
_preimage = jsoncodec.Writer(surrogates="refuse").dumps


def serialize_for_id(pubkey: str, created_at: int, kind: int, tags: Sequence[Sequence[str]], content: str) -> bytes:
    """The NIP-01 id preimage: compact JSON, non-ASCII verbatim (matches rust-nostr/serde_json).

    orjson writes exactly what C{json.dumps(..., separators=(",", ":"), ensure_ascii=False)} writes
    for strings and integers (short escapes, other C0 controls as lowercase C{\\u00xx}, everything
    else verbatim; checked over every code point), at a tenth of the cost. Values orjson refuses
    (integers beyond 64 bits) take the stdlib path.
    """
    return _preimage([0, pubkey, created_at, kind, tags, content])


def event_id(pubkey: str, created_at: int, kind: int, tags: Sequence[Sequence[str]], content: str) -> str:
    """The NIP-01 event id (lowercase hex SHA-256 of the id preimage)."""
    return hashlib.sha256(serialize_for_id(pubkey, created_at, kind, tags, content)).hexdigest()


class Signer:
    """A secret key and its x-only public key; never printed, never serialised by this class."""

    __slots__ = ("_key", "_keypair", "pubkey")

    def __init__(self, secret: bytes) -> None:
        if len(secret) != 32:
            raise ValueError("a secret key is 32 bytes")
        self._key = PrivateKey(secret)  # raises for 0 or >= the group order
        self.pubkey: str = PublicKeyXOnly.from_secret(secret).format().hex()
        # coincurve's sign_schnorr rebuilds the keypair (a point multiplication) and verifies the
        # signature on every call: three quarters of its cost. The keypair depends only on the key.
        self._keypair: Any = None
        if _LOW_LEVEL:
            keypair = _ffi.new("secp256k1_keypair *")
            if _lib.secp256k1_keypair_create(_CONTEXT.ctx, keypair, secret) == 1:
                self._keypair = keypair

    def __repr__(self) -> str:
        return f"<Signer {self.pubkey[:12]}...>"

    @property
    def secret(self) -> bytes:
        """The raw 32-byte secret (for encryption at rest and the NIP-44 conversation key only)."""
        return self._key.secret

    def sign(self, kind: int, tags: list[list[str]], content: str, created_at: int) -> Event:
        """Build and sign an event (BIP-340 with fresh auxiliary randomness)."""
        digest = hashlib.sha256(serialize_for_id(self.pubkey, created_at, kind, tags, content)).digest()
        return {
            "id": digest.hex(),
            "pubkey": self.pubkey,
            "created_at": created_at,
            "kind": kind,
            "tags": tags,
            "content": content,
            "sig": self.sign_digest(digest).hex(),
        }

    def sign_digest(self, digest: bytes) -> bytes:
        """BIP-340 signature of a 32-byte message with fresh auxiliary randomness."""
        if self._keypair is None:
            return self._key.sign_schnorr(digest, aux_randomness=b"")
        sig = _ffi.new("unsigned char[64]")
        if len(digest) != 32 or _lib.secp256k1_schnorrsig_sign32(_CONTEXT.ctx, sig, digest, self._keypair, os.urandom(32)) != 1:
            raise ValueError("signing failed")
        return bytes(_ffi.buffer(sig, 64))

    def conversation_key(self, peer_pubkey: str) -> bytes:
        """NIP-44 v2 conversation key with C{peer_pubkey} (see L{conversation_key})."""
        return conversation_key(self._key.secret, peer_pubkey)


def verify_event(ev: Event) -> bool:
    """Recompute the id and check the BIP-340 signature."""
    try:
        eid = event_id(ev["pubkey"], ev["created_at"], ev["kind"], ev["tags"], ev["content"])
        if eid != ev["id"]:
            return False
        return PublicKeyXOnly(bytes.fromhex(ev["pubkey"])).verify(bytes.fromhex(ev["sig"]), bytes.fromhex(eid))
    except Exception:
        return False


def generate_secret() -> bytes:
    """A fresh secret key."""
    return PrivateKey().secret


def conversation_key(secret: bytes, peer_pubkey: str) -> bytes:
    """NIP-44 v2: HMAC-SHA256(key="nip44-v2", msg=x(ECDH(secret, peer))), x unhashed.

    coincurve's C{PrivateKey.ecdh} hashes the shared point, so multiply explicitly instead.
    """
    point = PublicKey(b"\x02" + bytes.fromhex(peer_pubkey)).multiply(secret)
    shared_x = point.format(compressed=True)[1:]
    return hmac.new(b"nip44-v2", shared_x, hashlib.sha256).digest()


def d_tag(conv_key: bytes, slug: str) -> str:
    """NIP-AE d-tag: hex(HMAC-SHA256(K_c, "agent-memory/v1/d-tag" || 0x00 || utf8(slug)))."""
    return hmac.new(conv_key, _DTAG_LABEL + b"\x00" + slug.encode("utf-8"), hashlib.sha256).hexdigest()


# --- keys in text ---------------------------------------------------------------------------------

_BECH32 = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"


def _bech32_polymod(values: Iterable[int]) -> int:
    gen = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
    chk = 1
    for v in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ v
        for i in range(5):
            chk ^= gen[i] if (top >> i) & 1 else 0
    return chk


def bech32_decode(text: str) -> tuple[str, bytes]:
    """Decode a BIP-173 bech32 string into (hrp, 8-bit data); raises C{ValueError}."""
    if text.lower() != text and text.upper() != text:
        raise ValueError("mixed case")
    text = text.lower()
    pos = text.rfind("1")
    if pos < 1 or pos + 7 > len(text):
        raise ValueError("no separator")
    hrp, rest = text[:pos], text[pos + 1 :]
    try:
        data = [_BECH32.index(c) for c in rest]
    except ValueError:
        raise ValueError("bad character") from None
    expanded = [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]
    if _bech32_polymod(expanded + data) != 1:
        raise ValueError("bad checksum")
    acc = bits = 0
    out = bytearray()
    for v in data[:-6]:
        acc = (acc << 5) | v
        bits += 5
        if bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
    if bits >= 5 or (acc << (8 - bits)) & 0xFF:
        raise ValueError("bad padding")
    return hrp, bytes(out)


def parse_secret_key(text: str) -> bytes:
    """A secret key from 64 hex characters or an C{nsec1...} string; raises C{ValueError}."""
    text = text.strip()
    if text.lower().startswith("nsec1"):
        hrp, data = bech32_decode(text)
        if hrp != "nsec" or len(data) != 32:
            raise ValueError("not an nsec key")
        secret = data
    else:
        if len(text) != 64:
            raise ValueError("expected 64 hex characters or an nsec1 string")
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ValueError("expected 64 hex characters or an nsec1 string") from None
    Signer(secret)  # range check
    return secret


# --- NIP-10 threads (Buzz's marker form) ------------------------------------------------------------


def _is_hex64(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s.lower())


def thread_position(tags: Sequence[Sequence[str]]) -> tuple[str | None, str | None]:
    """(root, reply) from an event's own marker e-tags: the last valid of each wins."""
    root = reply = None
    for t in tags:
        if len(t) >= 4 and t[0] == "e" and _is_hex64(t[1]):
            if t[3] == "root":
                root = t[1].lower()
            elif t[3] == "reply":
                reply = t[1].lower()
    return root, reply


def thread_root_for_reply(parent: Event) -> str:
    """The thread root a reply to C{parent} belongs to, derived from the parent's signed tags."""
    root, reply = thread_position(parent["tags"])
    if root is not None:
        return root
    if reply is not None:
        return reply
    return str(parent["id"])


def reply_tags(channel: str, root: str, parent: str) -> list[list[str]]:
    """Buzz reply tags: direct reply carries only C{reply}; nested carries C{root} and C{reply}."""
    tags = [["h", channel]]
    if root != parent:
        tags.append(["e", root, "", "root"])
    tags.append(["e", parent, "", "reply"])
    return tags


def mention_tags(mentions: Iterable[str]) -> list[list[str]]:
    """One C{p} tag per distinct mention, first occurrence order."""
    seen: set[str] = set()
    out: list[list[str]] = []
    for m in mentions:
        m = m.lower()
        if m not in seen:
            seen.add(m)
            out.append(["p", m])
    return out


def tag_values(ev: Event, name: str) -> list[str]:
    """All first values of tags named C{name}."""
    return [t[1] for t in ev.get("tags", ()) if len(t) >= 2 and t[0] == name]


def newest_first_key(ev: Event) -> tuple[int, str]:
    """Sort key for the broker's read order: newest first, ties by id ascending."""
    return (-int(ev["created_at"]), str(ev["id"]))


def auth_event(
    signer: Signer, relay_url: str, challenge: str, created_at: int, attestation: list[str] | None = None
) -> Event:
    """A NIP-42 AUTH event (kind 22242), carrying the identity's owner attestation when it has one."""
    tags = [["relay", relay_url], ["challenge", challenge]]
    if attestation:
        tags.append(list(attestation))
    return signer.sign(KIND_AUTH, tags, "", created_at)


# NIP-OA: an owner vouches for an agent key with a BIP-340 signature over
# SHA-256("nostr:agent-auth:" + agent pubkey hex + ":" + conditions), carried as the tag
# ["auth", owner pubkey hex, conditions, signature hex]. Empty conditions: no restriction.
_ATTESTATION_PREFIX = b"nostr:agent-auth:"


def attestation_digest(agent_pubkey: str, conditions: str) -> bytes:
    """What the owner signs for C{agent_pubkey} under C{conditions}."""
    return hashlib.sha256(_ATTESTATION_PREFIX + agent_pubkey.encode("ascii") + b":" + conditions.encode("utf-8")).digest()


def owner_attestation(owner: Signer, agent_pubkey: str, conditions: str = "") -> list[str]:
    """The C{auth} tag by which C{owner} attests that it owns C{agent_pubkey} (never itself)."""
    if owner.pubkey == agent_pubkey:
        raise ValueError("an identity cannot attest itself")
    sig = owner.sign_digest(attestation_digest(agent_pubkey, conditions))
    return ["auth", owner.pubkey, conditions, sig.hex()]


def verify_attestation(tag: list[str], agent_pubkey: str) -> bool:
    """Whether C{tag} is a well-formed owner attestation for C{agent_pubkey} with a valid signature."""
    try:
        name, owner, conditions, sig = tag
        if name != "auth" or owner == agent_pubkey:
            return False
        return PublicKeyXOnly(bytes.fromhex(owner)).verify(bytes.fromhex(sig), attestation_digest(agent_pubkey, conditions))
    except Exception:
        return False
