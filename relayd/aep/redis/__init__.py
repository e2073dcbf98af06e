"""The AEP wing on Redis: the event log, the claims and the fan-out across instances."""
