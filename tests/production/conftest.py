"""The broker's real Nostr relay fixtures, for the production tests that drive the broker."""

from tests.buzz.conftest import nostr_relay, relay_for_class  # noqa: F401
