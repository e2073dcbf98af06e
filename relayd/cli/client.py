"""What the C{relayd-admin} tools that talk to a running relayd share: its URLs, plain standard-library
HTTP (the tools need no reactor and run wherever Python does), and stopping quietly on a signal."""

from __future__ import annotations

import http.client
import signal
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any

from relayd.cli import UsageError

DEFAULT_AEP = "http://127.0.0.1:8787"
DEFAULT_MCP = "http://127.0.0.1:8788"
DEFAULT_BROKER = "http://127.0.0.1:8789"
CACERT_HELP = "CA bundle for https relays [default: the system's]"


@dataclass
class Target:
    """A parsed base URL and how to reach it."""

    scheme: str
    host: str
    port: int
    path: str
    context: ssl.SSLContext | None = None

    @classmethod
    def parse(cls, url: str, cacert: str | None = None) -> Target:
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"not an http(s) URL: {url!r}")
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=cacert)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), context)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}{path}"


def request(
    target: Target, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """One request on its own connection: the status and the whole body."""
    conn = target.connection(timeout)
    try:
        conn.request(method, target.path + path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def auth(token: str | None) -> dict[str, str]:
    """The C{Authorization: Bearer} header for C{token}, if any (a token never goes in a URL)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def without_suffix(url: str, suffix: str) -> str:
    """C{url} without a trailing C{suffix} (an operator may paste the endpoint's URL, not the base)."""
    return url[: -len(suffix)] if url.rstrip("/").endswith(suffix) else url


def describe(e: BaseException) -> str:
    """An OS or HTTP error in a few words (no errno, no class path)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


class Stopped(Exception):
    """SIGINT or SIGTERM: stop quietly."""


def stop_on_signals() -> None:
    """Raise L{Stopped} in the main thread on SIGTERM or SIGINT."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
