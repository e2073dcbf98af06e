"""Raise the open-file limit at start: every SSE stream and WebSocket is a file descriptor.

As magic-wormhole-mailbox-server's C{increase_rlimits}: distributions often start services with a
soft limit of 1024, which a relay with a few thousand consumers exhausts (accept() then fails with
EMFILE). The soft limit is raised to the hard limit, or to the largest of a few steps the kernel
accepts.
"""

from __future__ import annotations

from twisted.logger import Logger

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

_log = Logger(namespace="relayd.rlimits")
TARGET = 1 << 20  # when the hard limit is "unlimited", ask for this much


def increase_rlimits() -> int | None:
    """Raise C{RLIMIT_NOFILE}'s soft limit as far as allowed; returns the limit in force (C{None}: unknown)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft >= ceiling:
        return soft
    for candidate in (ceiling, 65536, 10000, 3200, 1024):
        if candidate <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
        except (ValueError, OSError):
            continue
        _log.info("open-file limit raised from {old} to {new}", old=soft, new=candidate)
        return candidate
    return soft
