"""What TLS refused when a connection to Redis (a data node, a sentinel) was lost during its handshake."""

from __future__ import annotations

from typing import Any

from twisted.python.failure import Failure


def tls_failure(why: Failure) -> str | None:
    """What TLS refused (C{certificate verify failed}...), or C{None} for any other loss."""
    value: Any = why.value
    if type(value).__module__.startswith("service_identity"):
        return f"TLS: the certificate does not name the host ({value})"
    if not type(value).__module__.startswith("OpenSSL"):
        return None
    # pyOpenSSL's SSL.Error: a list of (library, function, reason) per OpenSSL error.
    reasons = [entry[-1] for entry in (value.args[0] if value.args else []) if isinstance(entry, tuple) and entry]
    return "TLS: " + ("; ".join(str(r) for r in reasons) or str(value))
