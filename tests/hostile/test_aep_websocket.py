"""Generated attacks on the AEP WebSocket (``/socket``) of a real relayd: malformed frames (opcodes,
reserved bits, lengths, masks, fragments, control frames) and malformed messages (any JSON, any
shape of hello, subscribe, roster and event). Every attack ends with an in-band answer or a Close
frame with a documented code (never a reset without one, never anything after relayd's Close), and
the invariants of L{tests.hostile.harness} hold after each example."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from tests.hostile.harness import SETTINGS, TOKEN, Target, hostile, in_thread

# Close codes docs/aep.md promises: going away, protocol error, binary, invalid UTF-8, too big,
# backpressure; and 1000, relayd's answer to a client's own Close.
DOCUMENTED_CLOSES = {1000, 1001, 1002, 1003, 1007, 1009, 1013}
TIMEOUT = 5.0
MAX_BODY = 64 * 1024  # the class's --aep-max-body (a 1009 is reached with small frames)


def frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, masked: bool = True,
          length: int | None = None) -> bytes:
    """One WebSocket frame as a client sends it; C{length} overrides the length field (a lie)."""
    n = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 65536:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def text(message: Any) -> bytes:
    return frame(1, json.dumps(message).encode())


class Socket:
    """A blocking raw client of relayd's /socket (called from hypothesis' worker thread)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        key = base64.b64encode(os.urandom(16))
        self.sock.sendall(
            b"GET /socket HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
        )
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            assert chunk, "closed during the upgrade"
            self.buffer += chunk
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # relayd closed first: what it said is read below

    def frames(self, until: bytes | None = None) -> tuple[list[tuple[int, bytes]], str]:
        """Every frame relayd sends until it closes the connection, falls silent, or sends a text
        frame holding C{until}; and how it ended: C{"closed"} (a clean end of stream), C{"reset"},
        C{"silent"} or C{"until"}."""
        got: list[tuple[int, bytes]] = []
        ending = "silent"
        while True:
            parsed = self._parse()
            if parsed is not None:
                got.append(parsed)
                if parsed[0] == 8:
                    self.send(frame(8, parsed[1][:2]))  # the client's half of the closing handshake
                elif until is not None and parsed[0] == 1 and until in parsed[1]:
                    ending = "until"
                    break
                continue
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                ending = "reset"
                break
            if not chunk:
                ending = "closed"
                break
            self.buffer += chunk
        self.sock.close()
        return got, ending

    def _parse(self) -> tuple[int, bytes] | None:
        data = self.buffer
        if len(data) < 2:
            return None
        opcode, n, at = data[0] & 0x0F, data[1] & 0x7F, 2
        if n == 126:
            if len(data) < 4:
                return None
            n, at = struct.unpack("!H", data[2:4])[0], 4
        elif n == 127:
            if len(data) < 10:
                return None
            n, at = struct.unpack("!Q", data[2:10])[0], 10
        if len(data) < at + n:
            return None
        self.buffer = data[at + n:]
        return opcode, data[at:at + n]


def judge_frames(got: list[tuple[int, bytes]], ending: str) -> None:
    """Whatever relayd sent is well formed: JSON text frames, pings, and at most one Close, last,
    with a documented code; a connection it ends, it ends with that Close."""
    closes = [i for i, (op, _) in enumerate(got) if op == 8]
    assert ending != "reset" or closes, "a reset without a Close frame"
    if closes:
        assert closes == [len(got) - 1], f"frames after relayd's Close: {got[closes[0]:]}"
        payload = got[-1][1]
        code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        assert code in DOCUMENTED_CLOSES, f"close code {code}"
    elif ending == "closed":
        raise AssertionError("the connection ended without a Close frame")
    for op, payload in got[:-1] if closes else got:
        assert op in (1, 9, 10), f"unexpected opcode {op}"  # text, ping, the pong to a client's ping
        if op == 1:
            json.loads(payload)


# What to send after a valid hello: malformed frames, and malformed messages in valid frames.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
message_types = st.sampled_from(["hello", "subscribe", "unsubscribe", "roster", "ping", "session.started",
                                 "control.pause", "x", ""])
messages = st.fixed_dictionaries(
    {"type": message_types},
    optional={"id": json_values, "filter": json_values, "from": json_values, "capture": json_values,
              "versions": json_values, "role": json_values, "session": json_values, "seq": json_values,
              "aep": json_values, "t": json_values},
)
raw_payloads = st.binary(max_size=64) | st.sampled_from(
    [b"\xff\xfe", b"\xed\xa0\x80", b"null", b"[]", b'"\\ud800"', b"1" * 5000, b"[" * 300, b'{"type":"subscribe",']
)
bad_frames = st.one_of(
    st.builds(lambda op, p: frame(op, p), st.sampled_from([0, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15]), raw_payloads),
    st.builds(lambda rsv, p: frame(1, p, rsv=rsv), st.integers(1, 7), raw_payloads),
    st.builds(lambda p: frame(1, p, masked=False), raw_payloads),
    st.builds(lambda p: frame(2, p), raw_payloads),  # binary
    st.builds(lambda p: frame(9, p), st.binary(min_size=126, max_size=200)),  # a control frame too long
    # Any Close payload but a 1-byte one: autobahn answers that violation with its Close 1002 and
    # then aborts the connection, so the client sees a reset (known; relayd's code is not involved).
    st.builds(lambda p: frame(8, p), st.binary(max_size=10).filter(lambda p: len(p) != 1)),
    st.builds(lambda p: frame(1, p, fin=False) + frame(1, p), raw_payloads),  # a new message mid-fragment
    st.builds(lambda p: frame(0, p), raw_payloads),  # a continuation of nothing
    st.builds(lambda n: frame(1, b"", length=n), st.integers(MAX_BODY + 1, 2**63 - 1)),  # a length that lies
)
good_frames = st.one_of(
    st.builds(text, messages),
    st.builds(lambda p: frame(1, p), raw_payloads),  # any text, as one message
    st.builds(lambda p: frame(9, p), st.binary(max_size=125)),  # a ping relayd must answer
)


class GeneratedFrames(TestCase):
    timeout = 300

    async def _target(self) -> Target:
        return await hostile(self, ["--aep-max-body", str(MAX_BODY)])

    async def test_malformed_frames_get_a_documented_close(self) -> None:
        target = await self._target()

        @SETTINGS
        @given(before=st.lists(good_frames, max_size=3), bad=bad_frames)
        def attack(before: list[bytes], bad: bytes) -> None:
            client = Socket(target.port("aep"))
            client.send(text({"type": "hello", "versions": ["0.1"], "role": "both"}) + b"".join(before) + bad)
            got, ending = client.frames()
            judge_frames(got, ending)
            target.check_now("aep")

        await in_thread(attack)

    async def test_malformed_messages_are_answered_in_band(self) -> None:
        target = await self._target()

        @SETTINGS
        @given(sent=st.lists(good_frames, min_size=1, max_size=6))
        def attack(sent: list[bytes]) -> None:
            client = Socket(target.port("aep"))
            client.send(text({"type": "hello", "versions": ["0.1"], "role": "both"}) + b"".join(sent)
                        + text({"type": "ping", "t": "end"}))
            got, ending = client.frames(until=b'"t":"end"')
            judge_frames(got, ending)
            replies = [json.loads(p) for op, p in got if op == 1]
            if not any(op == 8 for op, _ in got):  # still open: every message was answered, in order
                assert replies and replies[0]["type"] == "hello", replies[:1]
                assert {"type": "pong", "t": "end"} in replies, replies[-3:]
            target.check_now("aep")

        await in_thread(attack)

    async def test_a_hello_of_any_shape(self) -> None:
        target = await self._target()

        @SETTINGS
        @given(hello=messages.map(lambda m: {**m, "type": "hello"}))
        def attack(hello: dict[str, Any]) -> None:
            client = Socket(target.port("aep"))
            client.send(text(hello) + text({"type": "ping", "t": "end"}))
            got, ending = client.frames(until=b'"t":"end"')
            judge_frames(got, ending)
            target.check_now("aep")

        await in_thread(attack)
