"""The demo page (C{{prefix}/demo}): a browser tab that registers a session and hosts MCP tools."""

from __future__ import annotations

from importlib.resources import files


def demo_page() -> bytes:
    """The page's HTML (package data; it finds the relay at its own URL, so no templating)."""
    return files("relayd.mcp").joinpath("static/demo.html").read_bytes()
