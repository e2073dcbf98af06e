"""The access line's logger: one info event per request, or, while twistd's text log is the line's only
destination, its text straight into that log's turn writer.

Each answered request logs one line (relayd.web.site). Published as an event, it goes through the
publisher, the scrubber (which lets it pass: it is safe by construction) and twistd's text-file
observer, whose formatter (L{relayd.logs.access}) gives it the second's time prefix and whose stream,
a L{TurnWriter}, keeps it for the turn's end: ~15 k instructions of the ~220 k a keep-alive POST
costs (docs/performance.md). When those are the publisher's only observers, the same text, the
second's prefix then the line, is written to the same turn writer directly.

Whether they are is worked out once, and again whenever the publisher's observers change
(L{relayd.compat.logger.watch_observers}): any other observer (a JSON log, C{--logger}, a filter, a
test's) and every line is published as an event again, as it is without the shortcut.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger, LogLevel, LogPublisher, globalLogPublisher

from relayd.compat.logger import (
    is_text_observer,
    observers,
    text_observer_parts,
    unwatch_observers,
    watch_observers,
)
from relayd.logs.access import ACCESS_NAMESPACE, AccessLines
from relayd.logs.output import TurnWriter
from relayd.logs.scrub import SCRUBBED_MARK, scrub_in_place


class _Encoded:
    """A bytes stream seen as a text one: what a text-file observer made for a bytes stream writes."""

    __slots__ = ("out", "encoding")

    def __init__(self, out: Any, encoding: str) -> None:
        self.out = out
        self.encoding = encoding

    def write(self, text: str) -> None:
        self.out.write(text.encode(self.encoding))


class AccessLog(Logger):
    """The access line's logger: one info event per request, built as C{Logger.emit} builds one (the
    same keys) but without checking its level, which C{emit} does by sorting every log level for
    each event: a third of emitting an access line.

    Once L{write_directly} is called, a line whose event would only reach twistd's text-file
    observer (with relayd's formatter and turn writer, L{_direct_to}) and the scrubber, in the second
    of the last line that observer formatted, is L{written} to that turn writer as the observer would
    write it.
    """

    def __init__(self, publisher: LogPublisher | None = None) -> None:
        publisher = globalLogPublisher if publisher is None else publisher
        super().__init__(namespace=ACCESS_NAMESPACE, observer=publisher)
        self._publisher = publisher  # (the observer, as the publisher it is)
        # (the text observer's formatter, which holds the second's prefix; its stream's write), while
        # they are the only destination of the line; else None.
        self._direct: tuple[AccessLines, Any] | None = None
        self._watching = False

    def write_directly(self) -> None:
        """From now on, write each line straight to twistd's text log while that log (and the
        scrubber) is all that observes the publisher. Calling it again changes nothing."""
        if not self._watching:
            self._watching = watch_observers(self._publisher, self._recheck)
        self._recheck()

    def publish_only(self) -> None:
        """Publish every line as an event from now on (undoes L{write_directly})."""
        unwatch_observers(self._publisher, self._recheck)
        self._watching = False
        self._direct = None

    def _recheck(self) -> None:
        self._direct = _direct_to(observers(self._publisher)) if self._watching else None

    def written(self, when: float, text: str) -> bool:
        """Whether the access line C{text} at C{when} (the epoch) was written straight to the text log
        (L{write_directly}); if not, L{line} publishes it."""
        direct = self._direct
        if direct is None:
            return False
        lines, write = direct
        # The formatter's own test for reusing its prefix (relayd.logs.access.AccessLines): the first
        # line of each second is published, and the formatter keeps that second's prefix.
        if type(when) is not float or int(when) != lines.second or "\n" in text:
            return False
        try:
            write(f"{lines.prefix}{text}\n")
        except Exception:
            # As the publisher does with an observer that raised: it stays, and the failure goes to
            # the other observers, here the scrubber, which writes nothing.
            pass
        return True

    def line(
        self,
        when: float,
        text: str,
        relay: str,
        peer: str,
        method: str,
        path: str,
        status: int,
        sent: int,
        duration: float | None,
    ) -> None:
        """Publish the access line C{text} (rendered) and its fields as the info event C{{access_line}}
        at C{when} (the epoch): one dict, built whole (not grown to its fifteen keys)."""
        self.observer(
            {
                "access_line": text, "relay": relay, "peer": peer, "method": method, "path": path, "status": status,
                "bytes": sent, "duration_ms": duration,
                # Safe by construction (no query string, no headers): the scrubber need not render it.
                SCRUBBED_MARK: True,
                "log_logger": self, "log_level": LogLevel.info, "log_namespace": self.namespace, "log_source": None,
                "log_format": "{access_line}", "log_time": when,
            }
        )  # fmt: skip


def _direct_to(watched: list[Any]) -> tuple[AccessLines, Any] | None:
    """The formatter and the stream's write of the one text-file observer among C{watched} if every
    other one is the scrubber (which lets an access event pass untouched), the observer's formatter
    relayd's and its stream a turn writer (whose flush does nothing); else C{None}."""
    found: tuple[AccessLines, Any] | None = None
    for observer in watched:
        if observer is scrub_in_place:
            continue
        parts = text_observer_parts(observer)
        if found is not None or parts is None or not is_text_observer(observer):
            return None
        formatter, stream, encoding = parts
        if type(formatter) is not AccessLines or type(stream) is not TurnWriter:
            return None
        found = (formatter, stream.write if encoding is None else _Encoded(stream, encoding).write)
    return found


access_logger = AccessLog()
"""The access lines' logger, on the global publisher (a site's C{access_log} is whether it logs them)."""


def write_access_lines_directly() -> None:
    """Write access lines straight to twistd's text log while it is their only destination (the tap
    calls it once that log has relayd's formatter and turn writer). Calling it again changes nothing."""
    access_logger.write_directly()
