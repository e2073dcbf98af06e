"""Hypothesis strategies for hostile HTTP/1.1 requests, shared by the hostile tests.

Every strategy makes bytes a real client could put on a socket: request lines (methods, targets
with %-escapes, NUL, CR, lone LF, overlong, absolute-form, C{*}), header sets (duplicates, bad
names, obs-fold, non-ASCII, 600 fields, one 20 KiB field) and body framings (lengths of 5000
digits, negative, C{+1}, hex, both C{Content-Length} and C{Transfer-Encoding}, bad chunk sizes,
bodies that stop early).
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import strategies as st

from tests.hostile.harness import TOKEN, WINGS

# Requests that answer at once on each wing (no stream, no long-poll, no WebSocket upgrade).
PATHS = {
    "aep": [b"/healthz", b"/events", b"/connections", b"/.well-known/aep", b"/nope", b"/events/"],
    "mcp": [b"/", b"/healthz", b"/register", b"/s1/inbox", b"/s1/outbox", b"/s1/unregister", b"/nope"],
    "broker": [b"/v1/action", b"/v1", b"/", b"/v1/action/x", b"/healthz"],
    "metrics": [b"/metrics", b"/", b"/metrics/x"],
}
# Each wing's main POST route.
POSTS = {"aep": b"/events", "mcp": b"/register", "broker": b"/v1/action", "metrics": b"/metrics"}
TCHARS = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

wings = st.sampled_from(WINGS)
tokens = st.text(TCHARS, min_size=1, max_size=12).map(str.encode)
methods = st.one_of(
    st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT",
                     b"FOO", b"get", b"M-SEARCH", b"PROPFIND", b"PRI"]),
    tokens,
    st.binary(min_size=1, max_size=6),  # not a token: NUL, spaces, non-ASCII
)  # fmt: skip
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1", b""])
INSERTS = [b"\x00", b"\r", b"\n", b" ", b"\t", b"\x7f", b"\xff", b"\xc3\xa9", b"%", b"%00", b"%zz", b"%ff", b"%2e%2e/",
           b"%0d%0a", b"//", b"?", b"#frag", b'"', b"\\", b"?access_token=" + TOKEN.encode(), b"?filter=%7B%22"]  # fmt: skip


@st.composite
def targets(draw: Callable[..., Any], wing: str) -> bytes:
    """A request target: a known path, absolute-, authority- or asterisk-form, mutated or overlong."""
    form = draw(st.sampled_from(["origin", "origin", "origin", "absolute", "authority", "asterisk", "overlong", "empty"]))
    if form == "asterisk":
        return b"*"
    if form == "authority":
        return b"relay:80"
    if form == "empty":
        return b""
    path = draw(st.sampled_from(PATHS[wing]) | st.lists(st.text("abcxyz09-._~", max_size=6), max_size=4).map(
        lambda parts: "/" + "/".join(parts)).map(str.encode))  # fmt: skip
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(path)))
        path = path[:at] + draw(st.sampled_from(INSERTS)) + path[at:]
    if form == "absolute":
        path = draw(st.sampled_from([b"http://relay", b"https://relay:1", b"HTTP://x"])) + path
    if form == "overlong":
        path = path + b"/" + b"a" * draw(st.sampled_from([8000, 16500, 20 * 1024]))
    return path


@st.composite
def request_lines(draw: Callable[..., Any], wing_choice: st.SearchStrategy[str] = wings) -> tuple[str, bytes, bool]:
    """(wing, request bytes, whether the server can tell it is a HEAD)."""
    wing = draw(wing_choice)
    method, target, version = draw(methods), draw(targets(wing)), draw(versions)
    line = b" ".join(part for part in (method, target, version) if part) if version else method + b" " + target
    head = method == b"HEAD" and len(line) < 16000 and well_formed(line)
    return wing, line + b"\r\nHost: localhost\r\nConnection: close\r\n\r\n", head


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece = body[at : at + size]
        if not piece:
            break
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
        at += len(piece)
    if at < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - at, body[at:])
    return out + b"0\r\n\r\n"


header_names = st.one_of(
    tokens,
    st.sampled_from([b"Bad Name", b"X-A ", b" X-B", b"", b"X\x00Y", b"X-\xc3\xa9", b"X:Y", b"Host", b"Content-Type",
                     b"Authorization", b"Connection", b"Expect", b"Upgrade", b"Origin", b"aep-version"]),
)  # fmt: skip
header_values = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(str.encode),
    st.sampled_from([b"", b"\xff\xfe", "é☃".encode(), b"a\x00b", b"a\rb", b"a\nb", b"100-continue", b"websocket",
                     b"close", b"keep-alive", b"Upgrade, HTTP2-Settings", b"application/json", b"0.1",
                     b"Bearer " + TOKEN.encode(), b"Bearer nope"]),
)  # fmt: skip


@st.composite
def header_sets(draw: Callable[..., Any]) -> list[bytes]:
    """Header lines: random and duplicated fields, bad names, obs-fold, non-ASCII, very many or very long."""
    lines = [name + b": " + value for name, value in draw(st.lists(st.tuples(header_names, header_values), max_size=6))]
    extra = draw(st.sampled_from(["none", "none", "fold", "many", "long", "near-limit", "count-limit"]))
    if extra == "fold":
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from([b" folded", b"\tfolded", b"  "])))
    elif extra == "many":
        lines += [b"X-H%d: v" % i for i in range(600)]
    elif extra == "count-limit":  # Twisted's 500 fields, exactly and one over
        lines = [b"X-H%d: v" % i for i in range(draw(st.sampled_from([498, 499])))]
    elif extra == "long":
        lines.append(b"X-Big: " + b"a" * 20 * 1024)
    elif extra == "near-limit":  # the 16 KiB block, around its edge
        lines.append(b"X-Big: " + b"a" * draw(st.integers(16 * 1024 - 120, 16 * 1024 + 40)))
    return lines


@st.composite
def framings(draw: Callable[..., Any]) -> tuple[list[bytes], bytes, bool]:
    """(length headers, bytes after the header block, whether the request is complete)."""
    body = draw(st.binary(max_size=200) | st.sampled_from([b"{}", b'{"a":1}', b"[]", b"null", b"{" * 50]))
    kind = draw(st.sampled_from(["none", "length", "length", "chunked", "bad-length", "huge-length", "bad-chunk",
                                 "both", "two-lengths", "te-other", "truncated"]))  # fmt: skip
    if kind == "none":
        return [], b"", True
    if kind == "length":
        return [b"Content-Length: %d" % len(body)], body, True
    if kind == "chunked":
        sizes = draw(st.lists(st.integers(1, 64), max_size=4))
        te = draw(st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"]))
        return [b"Transfer-Encoding: " + te], chunked(body, sizes), True
    if kind == "bad-length":
        value = draw(st.sampled_from([b"-1", b"+1", b"0x10", b"1.0", b"1,1", b"1 1", b"", b"one", "١".encode(), b"1e3"]))
        return [b"Content-Length: " + value], body, True
    if kind == "huge-length":
        value = draw(st.sampled_from([b"9" * 5000, b"1" + b"0" * 19, b"99999999999", b"0" * 4999 + b"1"]))
        return [b"Content-Length: " + value], body[:50], value.lstrip(b"0") == b"1"
    if kind == "bad-chunk":
        chunk = draw(st.sampled_from([b"zz\r\nab\r\n", b"-1\r\nab\r\n", b"1;" + b"x" * 5000 + b"\r\na\r\n",
                                      b"2\r\nabc\r\n", b"0x2\r\nab\r\n", b"2 \r\nab\r\n", b"\r\n"]))  # fmt: skip
        return [b"Transfer-Encoding: chunked"], chunk + b"0\r\n\r\n", True
    if kind == "both":
        return [b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"], chunked(body, []), True
    if kind == "two-lengths":
        second = draw(st.sampled_from([len(body), len(body) + 1]))
        return [b"Content-Length: %d" % len(body), b"Content-Length: %d" % second], body, True
    if kind == "te-other":
        value = draw(st.sampled_from([b"gzip", b"chunked, chunked", b"identity", b"gzip, chunked", b"x"]))
        return [b"Transfer-Encoding: " + value], body, value == b"identity"
    # truncated: a body that stops early (the client then closes its side)
    declared = len(body) + draw(st.integers(1, 1000))
    return [b"Content-Length: %d" % declared], body, False


@st.composite
def header_attacks(
    draw: Callable[..., Any], wing_choice: st.SearchStrategy[str] = wings, credentials: dict[str, bytes] | None = None
) -> tuple[str, bytes, bool]:
    """(wing, request bytes, complete): a sane request line with hostile headers and framing; half
    carry the wing's bearer credential (C{credentials}, else the AEP token)."""
    wing = draw(wing_choice)
    method = draw(st.sampled_from([b"POST", b"POST", b"GET", b"PUT"]))
    path = POSTS[wing] if method != b"GET" else draw(st.sampled_from(PATHS[wing]))
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: localhost", b"Connection: close"]
    if draw(st.booleans()):
        lines.append(b"Authorization: Bearer " + (credentials or {}).get(wing, TOKEN.encode()))
    if wing == "aep" and draw(st.booleans()):
        lines += [b"aep-version: 0.1", b"content-type: application/x-ndjson"]
    lengths, body, complete = draw(framings())
    headers = draw(header_sets())
    lines[3:3] = headers
    for value in lengths:
        lines.insert(draw(st.integers(3, len(lines))), value)
    return wing, b"\r\n".join(lines) + b"\r\n\r\n" + body, complete


def well_formed(line: bytes) -> bool:
    """An RFC 9112 request line (method token, printable target, HTTP/1.x): only then does the
    server know the request is a HEAD."""
    parts = line.split(b" ")
    return (
        len(parts) == 3
        and bool(parts[0]) and all(chr(c) in TCHARS for c in parts[0])
        and bool(parts[1]) and all(0x21 <= c <= 0x7E for c in parts[1])
        and parts[2] in (b"HTTP/1.0", b"HTTP/1.1")
    )  # fmt: skip
