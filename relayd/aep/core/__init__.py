"""The AEP core: events, filters, the index, claims, the relay and its in-memory log; it imports no transport."""
