"""The echo wing's settings table (relayd.base.config rows: flag > environment > default)."""

from __future__ import annotations

from dataclasses import dataclass

from relayd.base.config import Resolved, Setting, endpoint

SETTINGS = [
    Setting(
        "echo-listen",
        [],
        "Echo wing listen endpoint (strports; repeatable); off unless given",
        parse=endpoint,
        env=("RELAYD_ECHO_LISTEN",),
        repeatable=True,
        metavar="ENDPOINT",
    ),
]


@dataclass(frozen=True)
class EchoConfig:
    """The echo wing's settings, typed."""

    listen: tuple[str, ...]

    @classmethod
    def from_settings(cls, settings: Resolved) -> EchoConfig | None:
        """The configuration, or C{None} when no listener is given (the wing is not started)."""
        listen = tuple(settings["echo-listen"])
        return cls(listen=listen) if listen else None
