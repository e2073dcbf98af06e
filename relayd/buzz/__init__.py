"""The Buzz agent broker host: keyless agents act on Nostr through named operations."""
