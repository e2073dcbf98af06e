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
