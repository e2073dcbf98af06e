// The official TypeScript MCP SDK (npm @modelcontextprotocol/sdk) as a client of relayd's standard
// endpoint. Run by tests/mcp/test_endpoint_node.py:
//
//     node ts_client.mjs http|sse URL TOKEN
//
// Lists the tools, calls one with a progress callback, waits for notifications/tools/list_changed
// (the page sends it after the client answered its ping), closes, and prints one JSON line.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { SSEClientTransport } from "@modelcontextprotocol/sdk/client/sse.js";
import { ToolListChangedNotificationSchema } from "@modelcontextprotocol/sdk/types.js";

const [mode, url, token] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${token}` };
const transport = mode === "sse"
  ? new SSEClientTransport(new URL(url), {
      requestInit: { headers },
      // The SSE stream is an EventSource: give it the header too.
      eventSourceInit: { fetch: (u, init) => fetch(u, { ...init, headers: { ...(init?.headers || {}), ...headers } }) },
    })
  : new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });

const out = { progress: [], list_changed: 0 };
const client = new Client({ name: "relayd-ts-test", version: "1" });
let changed;
const changedPromise = new Promise((resolve) => { changed = resolve; });
client.setNotificationHandler(ToolListChangedNotificationSchema, () => { out.list_changed++; changed(); });

client.onerror = (e) => console.error("client error:", e?.message ?? e);
const timer = setTimeout(() => { console.error("timed out"); process.exit(3); }, 30000);
await client.connect(transport);
out.version = transport.protocolVersion ?? null;
const tools = await client.listTools();
out.tools = tools.tools.map((t) => t.name);
const result = await client.callTool(
  { name: "whiteboard_add_sticky", arguments: { text: `hello from ts ${mode}` } },
  undefined,
  { onprogress: (p) => out.progress.push([p.progress, p.total ?? null, p.message ?? null]) },
);
out.result = result.content.map((c) => c.text);
await changedPromise;
if (mode !== "sse") await transport.terminateSession();
await client.close();
clearTimeout(timer);
console.log(JSON.stringify(out));
