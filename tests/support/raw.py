"""Raw HTTP over a blocking socket, for requests no HTTP client would send (run it in a thread)."""

from __future__ import annotations

import socket


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send C{request} to the host:port of C{url}; everything the server answers until it closes."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)
