"""The scrubber that keeps secrets out of every log record, and what the logs know of each wing.

Scrubbing removes bearer and basic credentials, C{access_token=}/C{token=}/C{key=}-style query and
form values, passwords in URLs (C{redis://user:password@host}), quoted JSON/dict values under secret names, fields whose name says they hold a secret
(C{token}, C{secret}, C{password}, C{credential}, C{authorization}, C{cookie}, C{*_key}, C{kek}, ...),
every credential format a wing declares (L{declare}, L{SecretFormat}) and every value registered with
L{register_secret} (relayd registers each configured secret setting). It applies to the observers of
relayd.logs.json and, once L{install_scrubber} has run (C{makeService} calls it), to every record
before any observer sees it, so twistd's default text log is scrubbed too.

A wing names the relay its namespace's records are about (L{declare}); L{relay_of} answers it for the
JSON records (C{metrics} for the C{relayd.metrics} namespace, the metrics module's log).
"""

from __future__ import annotations

import copy
import functools
import re
import string
from dataclasses import dataclass
from typing import Any, Callable

from twisted.logger import (
    ILogObserver,
    LogEvent,
    LogPublisher,
    formatEvent,
    globalLogPublisher,
)
from twisted.python.failure import Failure
from zope.interface import implementer, provider

from relayd.compat.logger import observe_first
from relayd.logs.access import is_port_noise

SCRUBBED = "[scrubbed]"

# Values that look like credentials wherever they appear.
_TEXT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Authorization schemes: "Bearer abc", "Basic dXNlcjpw", NIP-98 "Nostr eyJ..."
    (re.compile(r"(?i)\b(bearer|basic|nostr)(\s+)[A-Za-z0-9._~+/=:-]{4,}"), r"\1\2" + SCRUBBED),
    # Query-string and form pairs (also percent-encoded "=").
    (
        re.compile(
            r"(?i)\b((?:access_|refresh_|id_|auth_|api_|session_)?token|(?:api_|secret_|private_)?key|secret|"
            r"(?:sentinel_)?password|passwd|credential|kek|sig)(=|%3D)[^&\s\"'\\<>;,]+"
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


def relay_of(event: LogEvent) -> str | None:
    """The relay C{event} is about: its C{relay} field, else the relay declared for its namespace."""
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
