"""Production logging: JSON lines, and a scrubber that keeps secrets out of every record.

JSON lines (one record per line, stable keys)::

    twistd -n --logger=relayd.logging.json_observer relayd

    {"time":"2026-11-29T00:00:00.123Z","level":"info","relay":"aep","event":"aep listening on http://127.0.0.1:8787",
     "namespace":"relayd.listening","fields":{"relay":"aep","url":"http://127.0.0.1:8787"}}

C{time} is UTC ISO 8601 with milliseconds, C{level} one of C{debug info warning error critical},
C{relay} the relay the record is about or C{null} (its C{relay} field, else the relay a wing named for
the namespace it logged under, L{declare}; C{metrics} for C{relayd.metrics}), C{event} the formatted
message, C{fields} the structured values, and C{failure} a traceback when one was logged.

Scrubbing removes bearer and basic credentials, C{access_token=}/C{token=}/C{key=}-style query and
form values, passwords in URLs (C{redis://user:password@host}), quoted JSON/dict values under secret names, fields whose name says they hold a secret
(C{token}, C{secret}, C{password}, C{credential}, C{authorization}, C{cookie}, C{*_key}, C{kek}, ...),
every credential format a wing declares (L{declare}, L{SecretFormat}) and every value registered with
L{register_secret} (relayd registers each configured secret setting). It applies to the JSON and text
observers here and, once L{install_scrubber} has run (C{makeService} calls it), to every record before
any observer sees it, so twistd's default text log is scrubbed too.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import string
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any, Callable

from twisted.logger import (
    ILogObserver,
    LogEvent,
    LogLevel,
    LogPublisher,
    formatEvent,
    globalLogPublisher,
    textFileLogObserver,
)
from twisted.python.failure import Failure
from zope.interface import implementer, provider

from relayd.compat.web import observe_first, wrap_text_formatters

SCRUBBED = "[scrubbed]"

# Values that look like credentials wherever they appear.
_TEXT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Authorization schemes: "Bearer abc", "Basic dXNlcjpw", NIP-98 "Nostr eyJ..."
    (re.compile(r"(?i)\b(bearer|basic|nostr)(\s+)[A-Za-z0-9._~+/=:-]{4,}"), r"\1\2" + SCRUBBED),
    # Query-string and form pairs (also percent-encoded "=").
    (
        re.compile(
            r"(?i)\b((?:access_|refresh_|id_|auth_|api_|session_)?token|(?:api_|secret_|private_)?key|secret|"
            r"password|passwd|credential|kek|sig)(=|%3D)[^&\s\"'\\<>;,]+"
        ),
        r"\1\2" + SCRUBBED,
    ),
    # Quoted values under secret names in JSON and Python reprs: "token": "abc", 'token': b'abc'
    (
        re.compile(
            r"(?i)\"((?:access_|refresh_)?token|secret|password|credential|kek|nsec|(?:private_|secret_|api_)?key|"
            r"authorization)\"(\s*:\s*)\"(?:\\.|[^\"\\])*\""
        ),
        r'"\1"\2"' + SCRUBBED + '"',
    ),
    (
        re.compile(
            r"(?i)'((?:access_|refresh_)?token|secret|password|credential|kek|nsec|(?:private_|secret_|api_)?key|"
            r"authorization)'(\s*:\s*)(b?)'(?:\\.|[^'\\])*'"
        ),
        r"'\1'\2\3'" + SCRUBBED + "'",
    ),
    # Passwords in URLs: redis://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@"), r"\1" + SCRUBBED + "@"),
    # ... and, after these, the credential formats wings declare (declare).
]

# Every pattern above needs one of these in the text: one search decides for most strings.
_TRIGGERS = ["bearer", "basic", "nostr", "token", "key", "secret", "passw", "credential", "kek", "sig", "authoriz", "://"]
_TRIGGER = re.compile("(?i)" + "|".join(map(re.escape, _TRIGGERS)))

_SECRET_WORDS = (
    "token", "secret", "passw", "credential", "authoriz", "cookie", "nsec", "private", "apikey", "api_key", "seckey",
)
_SECRET_EXCEPTIONS = ("pubkey", "_hash", "count")

_secrets: set[str] = set()
_secrets_ordered: list[str] = []


def register_secret(value: str | bytes | None) -> None:
    """Scrub every literal occurrence of C{value} from now on (configured tokens, keys)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not value or len(value) < 4 or value in _secrets:
        return  # a 1-3 character "secret" would shred ordinary text and protects nothing
    _secrets.add(value)
    _secrets_ordered[:] = sorted(_secrets, key=len, reverse=True)


@dataclass(frozen=True)
class SecretFormat:
    """A credential format a wing issues or accepts, scrubbed wherever it appears in a record.

    @ivar pattern: a regular expression matching one credential (the whole match is scrubbed).
    @ivar trigger: a literal every match contains (compared ignoring case), so the one search that
        lets ordinary text through unscrubbed still finds it.
    """

    pattern: str
    trigger: str


@dataclass(frozen=True)
class WingLogs:
    """What relayd's logs know of one wing; the wing passes it to L{declare} when it is made.

    @ivar namespace: the wing's package: records logged under it (or below it) are about C{relay}.
    @ivar relay: the relay name its JSON records carry (the one its listener and metrics use).
    @ivar secret_formats: its credential formats, scrubbed from every record from then on.
    """

    namespace: str
    relay: str
    secret_formats: tuple[SecretFormat, ...] = ()


# The relay a namespace's records are about: the plumbing's metrics module here, each wing's package
# once the wing has declared it (declare).
_relays: dict[str, str] = {"relayd.metrics": "metrics"}


def declare(wing: WingLogs) -> None:
    """Name C{wing}'s relay for its namespace and scrub its credential formats from now on (a wing
    calls it first thing in C{make_wing}; declaring again changes nothing)."""
    global _TEXT_PATTERNS, _TRIGGER
    if _relays.get(wing.namespace) != wing.relay:
        _relays[wing.namespace] = wing.relay
        _relay_of_namespace.cache_clear()
    known = {pattern.pattern for pattern, _ in _TEXT_PATTERNS}
    for secret in wing.secret_formats:
        if secret.pattern in known:
            continue
        known.add(secret.pattern)
        # Rebound, never changed in place: a record being scrubbed meanwhile sees the old list or the new.
        _TEXT_PATTERNS = [*_TEXT_PATTERNS, (re.compile(secret.pattern), SCRUBBED)]
        if secret.trigger.lower() not in _TRIGGERS:
            _TRIGGERS.append(secret.trigger.lower())
            _TRIGGER = re.compile("(?i)" + "|".join(map(re.escape, _TRIGGERS)))


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a field named C{name} holds a secret (C{token}, C{api_key}, C{kek}, ... but not C{pubkey})."""
    n = name.lower().replace("-", "_")
    if any(word in n for word in _SECRET_EXCEPTIONS):
        return False
    if any(word in n for word in _SECRET_WORDS):
        return True
    return n in ("key", "kek", "sig") or n.endswith("_key") or n.endswith("_kek")


def scrub_text(text: str) -> str:
    """C{text} with every credential-looking value replaced by C{[scrubbed]}."""
    for secret in _secrets_ordered:
        if secret in text:
            text = text.replace(secret, SCRUBBED)
    if not _TRIGGER.search(text):
        return text  # the common case: an address, a path, a count
    for pattern, replacement in _TEXT_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _scrub_value(value: Any, depth: int = 0) -> Any:
    """A scrubbed version of a field value (the same object when nothing changed)."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, bytes):
        text = value.decode("latin-1")
        clean = scrub_text(text)
        return value if clean == text else clean.encode("latin-1", "replace")
    if depth > 4:
        return value
    if isinstance(value, dict):
        items = {k: (SCRUBBED if isinstance(k, str) and is_secret_name(k) and _is_texty(v) else _scrub_value(v, depth + 1))
                 for k, v in value.items()}
        return value if all(items[k] is value[k] for k in value) else items
    if isinstance(value, (list, tuple)):
        out = [_scrub_value(v, depth + 1) for v in value]
        if all(a is b for a, b in zip(out, value, strict=True)):
            return value
        return type(value)(out) if isinstance(value, tuple) and type(value) is tuple else out
    return value


def _is_texty(value: Any) -> bool:
    return isinstance(value, (str, bytes, dict, list, tuple))


# Keys Twisted owns whose values are not text to scrub (or are handled separately).
_UNTOUCHED = frozenset(
    ("log_logger", "log_source", "log_level", "log_namespace", "log_time", "log_trace", "log_failure", "log_format",
     "log_scrubbed", "log_relayd_scrubbed")
)
_MARK = "log_relayd_scrubbed"  # set on an event once scrubbed, so later observers need not do it again
SCRUBBED_MARK = _MARK  # for emitters whose events hold no secret by construction (the access log)


@functools.lru_cache(maxsize=1024)
def _plain_format(fmt: str) -> bool:
    """Whether C{str.format_map} renders C{fmt} as Twisted would (no Twisted-only C{{f()}} calls)."""
    try:
        return all(field is None or "(" not in field for _, field, _, _ in string.Formatter().parse(fmt))
    except ValueError:
        return False


def render(event: LogEvent) -> str:
    """The event's message, as C{twisted.logger.formatEvent} renders it (much faster for plain formats)."""
    fmt = event.get("log_format")
    if isinstance(fmt, str) and _plain_format(fmt):
        try:
            return fmt.format_map(event)
        except Exception:
            pass  # a missing key or a failing __format__: Twisted's formatter says so in its own words
    return formatEvent(event)


def scrub_in_place(event: LogEvent) -> None:
    """Remove secrets from C{event} itself: field values, the formatted message and any traceback."""
    if event.get(_MARK):
        return
    for key, value in list(event.items()):
        if key in _UNTOUCHED:
            continue
        if is_secret_name(key) and _is_texty(value):
            event[key] = SCRUBBED
            continue
        clean = _scrub_value(value)
        if clean is not value:
            event[key] = clean
    if event.get("log_format") is not None:
        # The format may reach into objects ({request.uri}) or join fields: check what it renders to.
        text = render(event)
        clean = scrub_text(text)
        if clean != text:
            event["log_format"] = "{log_scrubbed}"
            event["log_scrubbed"] = clean
    failure = event.get("log_failure")
    if isinstance(failure, Failure):
        event["log_failure"] = _scrub_failure(failure)
    event[_MARK] = True


provider(ILogObserver)(scrub_in_place)


def scrub_event(event: LogEvent) -> LogEvent:
    """A scrubbed copy of C{event} (the original is left as it is; an already scrubbed event is returned)."""
    if event.get(_MARK):
        return event
    clean = dict(event)
    scrub_in_place(clean)
    return clean


def _scrub_failure(failure: Failure) -> Failure:
    try:
        traceback = failure.getTraceback()
    except BaseException:
        return failure
    clean = scrub_text(traceback)
    if clean == traceback:
        return failure
    scrubbed = copy.copy(failure)
    scrubbed.value = _ScrubbedError(scrub_text(str(failure.value)))
    scrubbed.getTraceback = lambda *a, **kw: clean  # type: ignore[method-assign]
    return scrubbed


class _ScrubbedError(Exception):
    """Stands in for an exception whose message carried a secret."""


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


@implementer(ILogObserver)
class ScrubbingObserver:
    """Passes a scrubbed copy of every event to C{observer} (not Twisted's per-port lines)."""

    def __init__(self, observer: ILogObserver | Callable[[LogEvent], None]) -> None:
        self.observer = observer

    def __call__(self, event: LogEvent) -> None:
        if is_port_noise(event):
            return
        self.observer(scrub_event(event))


def install_scrubber(publisher: LogPublisher | None = None) -> None:
    """Scrub every event published through C{publisher} (the global one) before any observer sees it.

    The scrubber goes first among the publisher's observers (events are one shared dict), so the
    observer twistd or twist chose, before or after this call, only ever sees scrubbed events.
    """
    publisher = globalLogPublisher if publisher is None else publisher
    if getattr(publisher, "_relayd_scrubbing", False):
        return
    observe_first(publisher, scrub_in_place)
    publisher._relayd_scrubbing = True  # type: ignore[attr-defined]


# Access lines in twistd's text log ---------------------------------------------------------------------

ACCESS_NAMESPACE = "relayd.access"


class _AccessLines:
    """Formats access lines exactly as twistd's text observer does, at a fraction of the cost.

    Twisted's classic format runs its general formatter and converts the time zone for every line,
    and relayd writes one line per request. An access line is its pre-rendered text after a prefix
    (time, then C{[relayd.access#info]}) that changes once a second: the first line of each second
    is formatted by Twisted and its prefix is reused for the rest of that second; every other event
    goes to Twisted's formatter untouched.
    """

    def __init__(self, format_event: Callable[[LogEvent], str | None]) -> None:
        self.format_event = format_event
        self._second: int | None = None
        self._prefix = ""

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
        if second == self._second:
            return f"{self._prefix}{line}\n"
        text = self.format_event(event)
        tail = f"{line}\n"
        if text and text.endswith(tail):
            self._second, self._prefix = second, text[: -len(tail)]
        return text


def quicken_access_lines(publisher: LogPublisher | None = None) -> None:
    """Give twistd's text-file observer (whatever file it writes to) the fast access-line formatter,
    which also leaves out Twisted's per-port lines (L{is_port_noise}). Calling it again changes nothing."""
    publisher = globalLogPublisher if publisher is None else publisher
    wrap_text_formatters(publisher, _AccessLines)


# JSON lines ------------------------------------------------------------------------------------------

_LEVELS = {LogLevel.debug: "debug", LogLevel.info: "info", LogLevel.warn: "warning", LogLevel.error: "error",
           LogLevel.critical: "critical"}
# Legacy twisted.python.log keys that duplicate what the record already says.
_LEGACY = frozenset(("message", "format", "isError", "time", "system", "failure", "why", "relay", "log_scrubbed"))


def _relay_of(event: LogEvent) -> str | None:
    relay = event.get("relay")
    if isinstance(relay, str):
        return relay
    namespace = event.get("log_namespace")
    return _relay_of_namespace(namespace) if isinstance(namespace, str) else None


@functools.lru_cache(maxsize=1024)
def _relay_of_namespace(namespace: str) -> str | None:
    """The relay declared for C{namespace} or the nearest package above it (C{relayd.x.y} -> C{relayd.x})."""
    while namespace:
        relay = _relays.get(namespace)
        if relay is not None:
            return relay
        namespace = namespace.rpartition(".")[0]
    return None


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
        "relay": _relay_of(event),
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
    """C{twistd --logger=relayd.logging.json_observer}: JSON lines on stdout.

    The stream is taken now, before twistd redirects C{sys.stdout} into the log system.
    """
    return JSONLinesObserver(sys.stdout)


def text_observer() -> ILogObserver:
    """C{twistd --logger=relayd.logging.text_observer}: twistd's text format on stdout, scrubbed."""
    return ScrubbingObserver(textFileLogObserver(sys.stdout))
