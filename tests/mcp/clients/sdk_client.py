"""The official Python MCP SDK (PyPI C{mcp}) as a client of relayd's standard endpoint.

Run as a subprocess by the tests (the SDK is asyncio; relayd's tests run on Twisted's reactor):

    python sdk_client.py MODE URL TOKEN [TOOL]

MODE: C{client} (the SDK's default C{Client(url)}, token in C{?token=}), C{session} (C{ClientSession}
over Streamable HTTP, token as a bearer header), C{sse} (C{ClientSession} over legacy HTTP+SSE),
C{modern} (C{Client(url)} pinned to 2026-07-28, with a C{subscriptions/listen} stream), C{discover}
(the default C{Client(url)}, listing tools only).
It lists the tools, calls one with a progress callback, waits for C{notifications/tools/list_changed},
and prints one JSON line of what it saw. Exit status 0 on success.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import anyio
import httpx2
import mcp_types as types
from mcp import ClientSession
from mcp.client import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

TOOL = "whiteboard_add_sticky"


async def main(mode: str, url: str, token: str, tool: str = TOOL) -> dict[str, Any]:
    out: dict[str, Any] = {"progress": [], "list_changed": 0}
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        root = getattr(message, "root", message)
        if getattr(root, "method", None) == "notifications/tools/list_changed" or isinstance(
            root, types.ToolListChangedNotification
        ):
            out["list_changed"] += 1
            changed.set()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        out["progress"].append([progress, total, message])

    async def exercise(call_tool: Any, list_tools: Any) -> None:
        tools = await list_tools()
        out["tools"] = [t.name for t in tools.tools]
        result = await call_tool(tool, {"text": "hello from " + mode}, progress_callback=on_progress)
        out["result"] = [c.text for c in result.content]

    if mode == "client":
        async with Client(f"{url}?token={token}", message_handler=on_message) as client:
            out["version"] = client.protocol_version
            await exercise(client.call_tool, client.list_tools)
            await asyncio.wait_for(changed.wait(), 20)
    elif mode == "discover":
        async with Client(f"{url}?token={token}") as client:
            out["version"] = client.protocol_version
            tools = await client.list_tools()
            out["tools"] = [t.name for t in tools.tools]
    elif mode == "modern":
        async with Client(f"{url}?token={token}", mode="2026-07-28") as client:
            out["version"] = client.protocol_version
            async with client.listen(tools_list_changed=True) as events:
                await exercise(client.call_tool, client.list_tools)
                async for event in events:
                    out["list_changed"] += 1
                    out["event"] = type(event).__name__
                    break
    else:
        headers = {"Authorization": f"Bearer {token}"}
        if mode == "session":
            http = httpx2.AsyncClient(headers=headers, timeout=30)
            transport = streamable_http_client(url, http_client=http)
        else:
            transport = sse_client(url, headers=headers)
        try:
            async with transport as streams:
                read, write = streams[0], streams[1]
                async with ClientSession(read, write, message_handler=on_message) as session:
                    init = await session.initialize()
                    out["version"] = init.protocol_version
                    await exercise(session.call_tool, session.list_tools)
                    await asyncio.wait_for(changed.wait(), 20)
        except BaseExceptionGroup as group:
            # The SDK's legacy SSE reader hands a message that arrives while its session is closing (the
            # page's list_changed for another client joining, say) to the closed read stream, then the
            # error too, and fails with anyio.BrokenResourceError: its teardown race, after every answer
            # this client waited for arrived. Anything else, or before that, is a failure.
            if mode != "sse" or "result" not in out or group.split(anyio.BrokenResourceError)[1] is not None:
                raise
    return out


if __name__ == "__main__":
    result = asyncio.run(main(*sys.argv[1:5]))
    print(json.dumps(result), flush=True)
