"""JSON lines for production logs, and twistd's text format scrubbed.

JSON lines (one record per line, stable keys)::

    twistd -n --logger=relayd.logs.json.json_observer relayd

    {"time":"2026-11-29T00:00:00.123Z","level":"info","relay":"aep","event":"aep listening on http://127.0.0.1:8787",
     "namespace":"relayd.listening","fields":{"relay":"aep","url":"http://127.0.0.1:8787"}}

C{time} is UTC ISO 8601 with milliseconds, C{level} one of C{debug info warning error critical},
C{relay} the relay the record is about or C{null} (its C{relay} field, else the relay a wing named for
the namespace it logged under, L{relayd.logs.scrub.declare}; C{metrics} for the C{relayd.metrics}
namespace), C{event} the formatted message, C{fields} the structured values, and C{failure} a traceback
when one was logged. Both observers here scrub every record (L{relayd.logs.scrub.scrub_event}) and
leave out Twisted's per-port lines.
"""

from __future__ import annotations

import json
import math
import sys
from datetime import UTC, datetime
from typing import IO, Any

from twisted.logger import ILogObserver, LogEvent, LogLevel, textFileLogObserver
from zope.interface import implementer

from relayd.logs.access import is_port_noise
from relayd.logs.scrub import ScrubbingObserver, relay_of, render, scrub_event, scrub_text

_LEVELS = {LogLevel.debug: "debug", LogLevel.info: "info", LogLevel.warn: "warning", LogLevel.error: "error",
           LogLevel.critical: "critical"}
# Legacy twisted.python.log keys that duplicate what the record already says.
_LEGACY = frozenset(("message", "format", "isError", "time", "system", "failure", "why", "relay", "log_scrubbed"))


def _jsonable(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, LogLevel):
        return _LEVELS.get(value, value.name)
    if depth < 5:
        if isinstance(value, dict):
            return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [_jsonable(v, depth + 1) for v in value]
    try:
        text = repr(value)
    except Exception:
        text = f"<unrepresentable {type(value).__name__}>"
    return scrub_text(text[:2000])


def _iso(seconds: Any) -> str | None:
    if not isinstance(seconds, (int, float)):
        return None
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_as_json(event: LogEvent) -> str:
    """One scrubbed JSON object (no newline) for C{event}."""
    event = scrub_event(event)
    record: dict[str, Any] = {
        "time": _iso(event.get("log_time")),
        "level": _LEVELS.get(event.get("log_level"), "info"),
        "relay": relay_of(event),
        "event": scrub_text(render(event)),
        "namespace": event.get("log_namespace"),
        "fields": {
            key: _jsonable(value)
            for key, value in event.items()
            if not key.startswith("log_") and key not in _LEGACY
        },
    }
    failure = event.get("log_failure")
    if failure is not None:
        try:
            record["failure"] = scrub_text(failure.getTraceback())
        except BaseException:
            record["failure"] = scrub_text(repr(failure))
    return json.dumps(record, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


@implementer(ILogObserver)
class JSONLinesObserver:
    """Writes one scrubbed JSON object per line to a text stream."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def __call__(self, event: LogEvent) -> None:
        if is_port_noise(event):
            return
        try:
            line = event_as_json(event)
        except Exception as e:  # an observer must never raise (the publisher would drop it)
            line = json.dumps(
                {"time": _iso(event.get("log_time")), "level": "error", "relay": None,
                 "event": f"unloggable event ({type(e).__name__})", "namespace": event.get("log_namespace"),
                 "fields": {}}
            )
        self.out.write(line + "\n")
        self.out.flush()


def json_observer() -> ILogObserver:
    """C{twistd --logger=relayd.logs.json.json_observer}: JSON lines on stdout.

    The stream is taken now, before twistd redirects C{sys.stdout} into the log system.
    """
    return JSONLinesObserver(sys.stdout)


def text_observer() -> ILogObserver:
    """C{twistd --logger=relayd.logs.json.text_observer}: twistd's text format on stdout, scrubbed."""
    return ScrubbingObserver(textFileLogObserver(sys.stdout))
