"""What a request to the upstream Nostr relay can fail with; the host maps each to a verdict."""

from __future__ import annotations


class UpstreamError(Exception):
    """Base class of failures on the upstream Nostr relay's side."""


class NotConnected(UpstreamError):
    """The relay could not be reached (nothing was sent in this attempt)."""


class ConnectionLost(UpstreamError):
    """The connection dropped while a request was outstanding: its fate is unknown."""


class UpstreamTimeout(UpstreamError):
    """No OK/EOSE within the timeout."""


class QueryClosed(UpstreamError):
    """The relay refused a subscription (C{CLOSED}); the message is the relay's."""
