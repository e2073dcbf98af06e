"""NIP-42 for the test relay: an authenticated identity may read and write; an anonymous one may not."""

from __future__ import annotations

from typing import Any

from nostr_relay.auth import Authenticator


class RequireAuth(Authenticator):
    """With actions C{save: w, query: r}, only identities that completed AUTH get C{r}/C{w}."""

    async def authenticate(self, auth_event_json: dict[str, Any], challenge: str = "") -> dict[str, Any]:
        token = await super().authenticate(auth_event_json, challenge)
        token["roles"] = {"a", "r", "w"}
        return token


class RequireMembership(Authenticator):
    """A relay for members only, as a Buzz community relay is: an identity listed in the file named
    by C{RELAYD_TEST_MEMBERS} (one public key a line) may read and write; any other identity only
    when its AUTH event carries a valid owner attestation (NIP-OA C{auth} tag) by a member."""

    async def authenticate(self, auth_event_json: dict[str, Any], challenge: str = "") -> dict[str, Any]:
        token = await super().authenticate(auth_event_json, challenge)
        import os

        with open(os.environ["RELAYD_TEST_MEMBERS"]) as f:
            members = {line.strip() for line in f if line.strip()}
        pubkey = auth_event_json.get("pubkey")
        admitted = pubkey in members or any(
            t[:1] == ["auth"] and len(t) == 4 and t[1] in members and _attested(t, str(pubkey))
            for t in auth_event_json.get("tags", [])
        )
        token["roles"] = {"a", "r", "w"} if admitted else set()
        return token


def _attested(tag: list[str], agent: str) -> bool:
    """NIP-OA, checked here independently of relayd: BIP-340 by the owner over
    SHA-256("nostr:agent-auth:" + agent + ":" + conditions)."""
    import hashlib

    from coincurve import PublicKeyXOnly

    _, owner, conditions, sig = tag
    if owner == agent:
        return False
    digest = hashlib.sha256(f"nostr:agent-auth:{agent}:{conditions}".encode()).digest()
    try:
        return bool(PublicKeyXOnly(bytes.fromhex(owner)).verify(bytes.fromhex(sig), digest))
    except ValueError:
        return False
