"""The broker's client of its upstream Nostr relay (autobahn WebSocket): one NIP-42-authenticated
connection per identity, opened on demand.

By concern:
 - L{websocket}: the WebSocket protocol (autobahn with a fast path for plain text frames) and the
   endpoint each connection attempt uses;
 - L{connection}: L{UpstreamConnection}, one identity's conversation with the relay (AUTH, EVENT/OK,
   REQ/EOSE);
 - L{pool}: L{NostrRelayPool}, the connections by identity;
 - L{settings}: L{UpstreamSettings}, what every connection of a pool is configured with (the relay,
   time-outs, the reconnection backoff), so a connection never reads its pool;
 - L{errors}: what a request can fail with.

"Relay" alone means relayd itself elsewhere; here everything is named for the upstream Nostr relay.
"""

from __future__ import annotations

from relayd.buzz.nostr_upstream.connection import UpstreamConnection
from relayd.buzz.nostr_upstream.errors import ConnectionLost, NotConnected, QueryClosed, UpstreamError, UpstreamTimeout
from relayd.buzz.nostr_upstream.pool import NostrRelayPool

__all__ = [
    "ConnectionLost",
    "NostrRelayPool",
    "NotConnected",
    "QueryClosed",
    "UpstreamConnection",
    "UpstreamError",
    "UpstreamTimeout",
]
