"""Acceptance 4: a real headless Chromium page, served from another origin than the relay, registers a
session, reads C{inbound} with C{EventSource} and answers C{tools/list} by POSTing to C{outbox}; an agent
in the test gets the answer over SSE and over poll. With a CORS list that lacks the page origin the
browser refuses to read.

Skips locally when Chromium, chromedriver or selenium is missing; fails instead under C{CI=true}
(tests/support/browser.py). Selenium blocks, so every browser step runs in a thread (the relay and
the page server run in this test's reactor).
"""

from __future__ import annotations

import json

from twisted.internet import reactor, threads
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from tests.support.browser import WAIT, require_browser, start_browser, wait_for
from tests.support.mcp import TOKEN, McpRelayCase, next_mcp

SESSION = "brws01"

PAGE = b"""<!doctype html><html><head><meta charset="utf-8"><title>page</title></head><body><script>
const q = new URLSearchParams(location.search);
const relay = q.get('relay'), session = q.get('session'), token = q.get('token');
window.state = {registered: null, opened: false, received: [], posted: [], errors: [], esErrors: []};
function post(path, body) {
  return fetch(relay + path, {method: 'POST', headers: {'content-type': 'application/json'},
                              body: JSON.stringify(body)});
}
post('/register', {session: session, token: token})
  .then(r => { state.registered = r.status; })
  .catch(e => { state.registered = 'failed'; state.errors.push('register: ' + e.name + ': ' + e.message); })
  .finally(() => {
    const es = new EventSource(relay + '/' + session + '/events?token=' + token + '&direction=inbound');
    es.onopen = () => { state.opened = true; };
    es.onerror = () => { state.esErrors.push(es.readyState); };
    es.addEventListener('mcp', ev => {
      const msg = JSON.parse(ev.data);
      state.received.push(msg);
      if (msg.method === 'tools/list') {
        post('/' + session + '/outbox?token=' + token,
             {jsonrpc: '2.0', id: msg.id, result: {tools: [{name: 'page_tool', inputSchema: {type: 'object'}}]}})
          .then(r => state.posted.push(r.status))
          .catch(e => state.errors.push('outbox: ' + e.name + ': ' + e.message));
      }
    });
  });
</script></body></html>"""


class PageResource(Resource):
    """Serves the page at any path of the page server (a different origin from the relay)."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return PAGE


class BrowserCase(McpRelayCase):
    timeout = 120
    allow_page_origin = True

    async def setUp(self) -> None:  # type: ignore[override]
        require_browser()
        # The page server first: its origin goes into the relay's CORS list.
        self.page_port = reactor.listenTCP(0, Site(PageResource()), interface="127.0.0.1")
        self.addCleanup(self.page_port.stopListening)
        self.page_origin = f"http://127.0.0.1:{self.page_port.getHost().port}"
        allowed = self.page_origin if self.allow_page_origin else "http://127.0.0.1:1"
        await self.start_relay(flags={"mcp-cors": [f"https://elsewhere.example,{allowed}"]})
        self.driver = await start_browser(self)

    def page_url(self) -> str:
        return f"{self.page_origin}/page.html?relay={self.base}&session={SESSION}&token={TOKEN}"


class AllowedOriginTests(BrowserCase):
    async def test_page_answers_tools_list_over_sse_and_poll(self) -> None:
        await threads.deferToThread(self.driver.get, self.page_url())
        state = await threads.deferToThread(wait_for, self.driver, "return window.state && window.state.opened")
        self.assertEqual(state["registered"], 200)
        # The agent: one SSE reader and one poller, both outbound.
        agent = await self.events(SESSION, "&direction=outbound")
        first = await self.poll(SESSION, "&direction=outbound&wait=0")
        sub = first.json()["subscriber"]
        reply = await self.post(f"/{SESSION}/inbox?token={TOKEN}", raw=b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}')
        self.assertEqual(reply.code, 200)
        over_sse = json.loads((await next_mcp(agent, timeout=WAIT)).data)
        self.assertEqual(over_sse["id"], 1)
        self.assertEqual(over_sse["result"]["tools"][0]["name"], "page_tool")
        polled = (await self.poll(SESSION, f"&direction=outbound&wait=20000&subscriber={sub}")).json()
        self.assertEqual([json.loads(f) for f in polled["frames"]], [over_sse])
        state = await threads.deferToThread(wait_for, self.driver, "return window.state.posted.length > 0")
        self.assertEqual(state["posted"], [200])
        self.assertEqual(state["errors"], [])
        methods = [m.get("method") for m in state["received"]]
        self.assertEqual(sorted(methods[:2]), ["notifications/peer_joined"] * 2)
        self.assertEqual(methods[2:], ["tools/list"])


class RefusedOriginTests(BrowserCase):
    allow_page_origin = False

    async def test_browser_refuses_to_read(self) -> None:
        await self.register(SESSION)  # so the only obstacle left is CORS
        await threads.deferToThread(self.driver.get, self.page_url())
        state = await threads.deferToThread(
            wait_for, self.driver, "return window.state.registered !== null && window.state.esErrors.length > 0"
        )
        self.assertEqual(state["registered"], "failed")
        self.assertIn("register: TypeError: Failed to fetch", state["errors"])
        self.assertFalse(state["opened"])
        self.assertEqual(state["esErrors"][0], 2)  # CLOSED: the browser gives up, no reconnect
        self.assertEqual(state["received"], [])
        log = await threads.deferToThread(self.driver.get_log, "browser")
        self.assertTrue(any("blocked by CORS policy" in entry["message"] for entry in log), log)
