"""Access lines in twistd's text log: their namespace, a fast formatter, and Twisted's port lines left out.

A wing's site logs one line per request under L{ACCESS_NAMESPACE}; L{quicken_access_lines} gives
twistd's text-file observer a formatter that renders them at a fraction of Twisted's cost and leaves
out Twisted's own per-port lines (L{is_port_noise}), which relayd's listening lines say once.
"""

from __future__ import annotations

import re
from typing import Callable

from twisted.logger import LogEvent, LogLevel, LogPublisher, globalLogPublisher

from relayd.compat.logger import observers_changed, wrap_text_formatters

# Twisted's own lines about each listening port ("RelaySite starting on 8787", "(TCP Port 8787
# Closed)"): relayd's "<wing> listening on <url>" and "<wing>: stopped listening" lines say it, once,
# with the wing's name. Only listening ports log these, and every one in relayd is a wing's.
_PORT_NOISE = re.compile(r"(?:RelaySite starting on .+|\((?:TCP|UNIX) Port .+ Closed\))\Z", re.S)


def is_port_noise(event: LogEvent) -> bool:
    """Whether C{event} is one of Twisted's per-port lines that relayd's output leaves out."""
    if event.get("log_namespace") != "log_legacy":
        return False
    message = event.get("message")
    return (
        type(message) is tuple
        and len(message) == 1
        and type(message[0]) is str
        and _PORT_NOISE.match(message[0]) is not None
    )


ACCESS_NAMESPACE = "relayd.access"


class AccessLines:
    """Formats access lines exactly as twistd's text observer does, at a fraction of the cost.

    Twisted's classic format runs its general formatter and converts the time zone for every line,
    and relayd writes one line per request. An access line is its pre-rendered text after a prefix
    (time, then C{[relayd.access#info]}) that changes once a second: the first line of each second
    is formatted by Twisted and its prefix is reused for the rest of that second; every other event
    goes to Twisted's formatter untouched.
    """

    def __init__(self, format_event: Callable[[LogEvent], str | None]) -> None:
        self.format_event = format_event
        # The second of the last line Twisted formatted, and that line's text before the line itself
        # (relayd.logs.access_log writes lines of that second with it too).
        self.second: int | None = None
        self.prefix = ""

    def __call__(self, event: LogEvent) -> str | None:
        line = event.get("access_line")
        when = event.get("log_time")
        if (
            type(line) is not str
            or type(when) is not float
            or event.get("log_namespace") != ACCESS_NAMESPACE
            or event.get("log_level") is not LogLevel.info
            or "log_failure" in event
            or "log_system" in event
            or "\n" in line
        ):
            return None if is_port_noise(event) else self.format_event(event)
        second = int(when)
        if second == self.second:
            return f"{self.prefix}{line}\n"
        text = self.format_event(event)
        tail = f"{line}\n"
        if text and text.endswith(tail):
            self.second, self.prefix = second, text[: -len(tail)]
        return text


def quicken_access_lines(publisher: LogPublisher | None = None) -> None:
    """Give twistd's text-file observer (whatever file it writes to) the fast access-line formatter,
    which also leaves out Twisted's per-port lines (L{is_port_noise}). Calling it again changes nothing."""
    publisher = globalLogPublisher if publisher is None else publisher
    wrap_text_formatters(publisher, AccessLines)
    observers_changed(publisher)  # (an observer's formatter is now relayd's: relayd.logs.access_log)
