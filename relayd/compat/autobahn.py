"""The fence's autobahn entries: a WebSocket's send queue, compression and parser state.

What each shortcut saves is measured in docs/performance.md ("Twisted internals").
"""

from __future__ import annotations

from typing import Any

from autobahn.twisted.websocket import WebSocketAdapterProtocol
from autobahn.websocket.protocol import WebSocketProtocol

from relayd.compat.detect import code_uses

WS_SEND_STATE = code_uses(WebSocketProtocol.sendPreparedMessage, "_perMessageCompress") and code_uses(
    WebSocketProtocol.sendData, "send_queue"
)
"""autobahn compresses per message when C{_perMessageCompress} is set and queues in C{send_queue}."""
WS_RECEIVE_STATE = code_uses(WebSocketProtocol.processData, "current_frame", "inside_message", "data", "_perMessageCompress")
"""autobahn's parser is between frames when it has no current frame, message or buffered data."""
WS_QUIET_RECEIVE = hasattr(WebSocketProtocol, "_dataReceived") and code_uses(
    WebSocketAdapterProtocol.dataReceived, "_dataReceived"
)
"""autobahn's C{dataReceived} formats a debug line, then parses in C{_dataReceived}."""


def ws_frames_direct(protocol: Any) -> bool:
    """Whether frames already framed for C{protocol} may be written to its transport directly.

    autobahn's per-message send path formats a debug log line per message; frames prepared once per
    event for every connection then cost a write each: a WebSocket delivery to 100 subscribers went
    from 15.4 to 3.2 us with the fan-out's other changes (docs/performance.md).
    """
    return WS_SEND_STATE and protocol._perMessageCompress is None and not protocol.send_queue


def ws_parser_idle(protocol: Any) -> bool:
    """Whether C{protocol}'s parser is between messages and uncompressed: complete plain frames at
    the head of a read may be handled without it (the broker host's relay client)."""
    return (
        WS_RECEIVE_STATE
        and protocol.current_frame is None
        and not protocol.inside_message
        and not protocol.data
        and protocol._perMessageCompress is None
    )


def ws_data_received(protocol: Any, data: bytes) -> None:
    """Hand C{data} to autobahn's parser without its per-read debug-log formatting (6-8 us per
    read, bench/internals.py)."""
    if WS_QUIET_RECEIVE:
        protocol._dataReceived(data)
    else:
        WebSocketAdapterProtocol.dataReceived(protocol, data)
