"""The one AEP ingest check: what a batch's headers and size must be, and the batch parser.

Every way a batch comes in asks this module and nothing else: twisted.web's render of
C{POST /events} (L{relayd.aep.http.AEPResource.ingest}), the answer its headers alone get before the
body is read (C{early_answer}, C{too_large}) and the plain-POST path beside twisted.web
(C{simple_ingest}). The transports read the bytes (the header values, the media type) and speak
HTTP; this module decides and names the refusal (docs/aep.md, "What a refusal names").
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from typing import Any, Final

from relayd.aep.core.envelope import classify
from relayd.aep.core.event import Event, JSONError, admit, admit_lines, parse_json, plain_body

JSON_TYPE: Final = b"application/json"
NDJSON_TYPE: Final = b"application/x-ndjson"
VERSIONS: Final = (b"0.1",)

# Lines parsed per reactor turn: a batch of 10 000 events (100-200 ms of parsing) never holds the
# reactor, and every other connection waits at most one slice.
PARSE_SLICE = 1000


class IngestError(Exception):
    """An ingest refusal: its status, its JSON body (C{None}: an empty body) and the reason the
    refusal metric counts it under."""

    def __init__(self, status: int, body: dict[str, Any] | None, reason: str | None = None) -> None:
        self.status = status
        self.body = body
        self.reason = reason if reason is not None else str((body or {}).get("error", status))


# The protocol's bodies ({"versions": [...]} for 426, none for 415), with what a person at a terminal
# needs beside them: the 426 names the header in members a client reading `versions` ignores; the
# 415, whose body the protocol keeps empty, names the media types in Accept-Post (W3C LDP, RFC 5789's
# registry), which the transports send with it.
VERSION_UNSUPPORTED: Final = IngestError(
    426,
    {
        "versions": ["0.1"],
        "error": "version-unsupported",
        "header": "aep-version",
        "detail": "send the header aep-version: 0.1 (the AEP version this relay speaks) with every POST",
    },
    "version-unsupported",
)
MEDIA_UNSUPPORTED: Final = IngestError(415, None, "unsupported-media-type")
ACCEPT_POST: Final = (b"accept-post", b"application/json, application/x-ndjson")


class IngestPolicy:
    """The limits of one relay's ingest and the one check of a batch against them."""

    def __init__(self, max_body: int, max_batch: int) -> None:
        self.max_body = max_body
        self.max_batch = max_batch

    def refusal(self, versions: Sequence[bytes] | None, media: bytes, length: int | None = None) -> IngestError | None:
        """Why a batch sent with these C{aep-version} header values, this media type (lower-cased,
        without parameters) and a body of C{length} bytes (C{None}: not known yet) is refused, in
        the reference's order (426, 415, 413); C{None} to read it."""
        if versions is None or len(versions) != 1 or versions[0] not in VERSIONS:
            return VERSION_UNSUPPORTED
        if media != JSON_TYPE and media != NDJSON_TYPE:
            return MEDIA_UNSUPPORTED
        if length is not None and length > self.max_body:
            return self.too_large()
        return None

    def too_large(self) -> IngestError:
        """The refusal of a body over the cap (asked by the body limit once the headers passed)."""
        return IngestError(413, {"error": "payload-too-large", "max_bytes": self.max_body})

    def parser(self, body: bytes, media: bytes) -> BatchParser:
        """The parser of a body L{refusal} let through."""
        return BatchParser(body, media == NDJSON_TYPE, self.max_batch)

    def plain_events(self, body: bytes, media: bytes) -> list[Event] | None:
        """The events of a body L{refusal} let through, when it is one plainly valid JSON event
        (L{admit}): what L{parser} would find, without it (one event per POST, the usual
        client's); C{None} for anything else, which L{parser} reads."""
        if media != JSON_TYPE or self.max_batch < 1:
            return None
        event = admit(body.strip())
        return None if event is None else [event]


def event_or_problem(value: Any, raw: bytes) -> Event | str:
    """The event C{value} (parsed from C{raw}) is, or what is wrong with it (the detail of an
    C{invalid-event}): the one verdict of HTTP batches and WebSocket messages alike."""
    kind = classify(value)
    if type(kind) is str:
        return kind
    return Event.of(value, raw, kind)  # type: ignore[arg-type]


class BatchParser:
    """An ingest body parsed a slice of lines at a time; nothing is ingested before all of it is
    valid (docs/decisions.md AEP-5).

    Plainly valid lines become events at once; the others are parsed exactly, so that the first
    invalid-json line is reported before the count and the first invalid-event line after it.
    """

    def __init__(self, body: bytes, ndjson: bool, max_batch: int) -> None:
        if ndjson:
            # The lines as split at line feeds and stripped, cut by BytesIO.readlines: it finds each
            # line feed with memchr, where bytes.split(b"\n") compares byte by byte (a POST of 100
            # lines of 546 bytes: 167 k instructions against 375 k, docs/performance.md).
            self.lines = list(filter(None, map(bytes.strip, BytesIO(body).readlines())))
        else:
            self.lines = [body.strip()]
        # A line feed ends an NDJSON line, so what the whole body settles holds for each line; a
        # JSON body is one value that may span lines (L{admit} refuses those, for SSE framing).
        self._plain = plain_body(body, max(map(len, self.lines), default=0)) if ndjson else None
        self._ndjson = ndjson
        self.max_batch = max_batch
        self._admitted: list[Event | None] = []
        self._values: dict[int, Any] = {}

    def step(self, count: int) -> bool:
        """Read up to C{count} more lines; C{True} once every line is read.

        @raise IngestError: 400 invalid-json with the line and what is wrong with it.
        """
        lines, admitted, values = self.lines, self._admitted, self._values
        start = len(admitted)
        end = min(len(lines), start + count)
        if self._ndjson:
            admitted.extend(admit_lines(lines[start:end], self._plain))
        else:
            admitted.extend(map(admit, lines[start:end]))
        if None not in admitted[start:end]:  # (one C scan: the usual slice is all admitted)
            return end == len(lines)
        for index in range(start, end):
            if admitted[index] is None:
                try:
                    values[index] = parse_json(lines[index])
                except JSONError as e:
                    raise IngestError(400, {"error": "invalid-json", "line": index, "detail": str(e)}) from None
        return end == len(lines)

    def result(self) -> list[Event]:
        """The events, once L{step} has read every line.

        @raise IngestError: 413 too-many-events or 400 invalid-event with the line.
        """
        lines, admitted = self.lines, self._admitted
        if len(lines) > self.max_batch:
            raise IngestError(413, {"error": "too-many-events", "max": self.max_batch, "count": len(lines)})
        for index, value in self._values.items():
            verdict = event_or_problem(value, lines[index])
            if type(verdict) is str:
                raise IngestError(400, {"error": "invalid-event", "line": index, "detail": verdict})
            admitted[index] = verdict  # type: ignore[assignment]
        return admitted  # type: ignore[return-value]


def parse_batch(body: bytes, ndjson: bool, max_batch: int) -> list[Event]:
    """Parse and validate a whole ingest body at once (L{BatchParser} in one step)."""
    parser = BatchParser(body, ndjson, max_batch)
    parser.step(len(parser.lines))
    return parser.result()
