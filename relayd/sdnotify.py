"""systemd readiness notification (sd_notify): C{READY=1} once listening, C{STOPPING=1} at shutdown.

Twisted has no sd_notify; this is the small datagram send synapse uses. It does nothing unless
systemd (or a test) set C{NOTIFY_SOCKET}, so a unit can use C{Type=notify} and be considered started
only once every relay is accepting connections.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

from twisted.logger import Logger

_log = Logger(namespace="relayd.sdnotify")


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send C{state} (e.g. C{"READY=1"}) to C{$NOTIFY_SOCKET}; C{False} when unset or unreachable.

    A path starting with C{@} is a Linux abstract socket. Failures are logged, never raised: a
    missing supervisor must not stop relayd.
    """
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError as e:
        _log.warn("sd_notify {state} to NOTIFY_SOCKET failed: {error}", state=state, error=e)
        return False
    return True
