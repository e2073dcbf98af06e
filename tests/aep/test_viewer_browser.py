"""The live event viewer (issue 26 acceptance 1): served at C{/} and C{/viewer} without the token, and
driven in a real headless Chromium against a relay that has one: it asks for the token, shows events
posted after it loaded, filters, pauses and resumes without losing or repeating an event, replays
history, counts gaps, and renders markup from events as text.

The browser tests skip locally when Chromium, chromedriver or selenium is missing; they fail instead
under C{CI=true} (tests/support/browser.py). Selenium blocks, so every browser step runs in a thread
(the relay runs in this test's reactor).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from tests.support.aep import AEPRelay, event, start_relay
from tests.support.browser import require_browser, start_browser, wait_for

TOKEN = "viewer-t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def header(response: Any, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0] if values else None


class ViewerServed(TestCase):
    async def setUp(self) -> None:  # type: ignore[override]
        self.relay = await start_relay(self, aep_token=TOKEN)

    async def test_page_script_and_style_are_served_without_the_token(self) -> None:
        kinds = {
            "/": "text/html; charset=utf-8",
            "/viewer": "text/html; charset=utf-8",
            "/viewer.js": "text/javascript; charset=utf-8",
            "/viewer.css": "text/css; charset=utf-8",
        }
        for path, kind in kinds.items():
            for method in ("GET", "HEAD"):
                response, body = await self.relay.request(method, path)
                self.assertEqual((response.code, header(response, "content-type")), (200, kind), (method, path))
                policy = header(response, "content-security-policy") or ""
                self.assertIn("default-src 'none'", policy)
                self.assertIn("connect-src 'self'", policy)
                self.assertEqual(header(response, "x-content-type-options"), "nosniff")
                if method == "GET":
                    # Nothing from another origin: no CDN, no absolute URL at all.
                    self.assertNotIn(b"://", body, path)
                else:
                    self.assertEqual(body, b"")
        _, page = await self.relay.get("/")
        self.assertIn(b'src="viewer.js"', page)

    async def test_everything_else_stays_behind_the_wall(self) -> None:
        for method, path in (("GET", "/stream"), ("POST", "/viewer"), ("GET", "/viewer/"), ("GET", "/viewer.html")):
            response, body = await self.relay.request(method, path)
            self.assertEqual((response.code, body), (401, b""), (method, path))
        response, _ = await self.relay.request("POST", "/viewer", headers=AUTH)
        self.assertEqual((response.code, header(response, "allow")), (405, "GET, HEAD"))
        response, _ = await self.relay.request("GET", "/viewer.html", headers=AUTH)
        self.assertEqual(response.code, 404)


class ViewerCase(TestCase):
    """A relay with a token and a headless Chromium; the helpers drive the viewer's page."""

    timeout = 120
    relay_token: str | None = TOKEN
    relay_flags: dict[str, Any] = {}

    async def setUp(self) -> None:  # type: ignore[override]
        require_browser()
        token = {} if self.relay_token is None else {"aep_token": self.relay_token}
        self.relay: AEPRelay = await start_relay(self, **token, **self.relay_flags)
        self.driver = await start_browser(self)

    async def js(self, script: str, *args: Any) -> Any:
        return await threads.deferToThread(self.driver.execute_script, script, *args)

    async def until(self, condition: str) -> None:
        await threads.deferToThread(wait_for, self.driver, condition, "return true")

    async def until_state(self, state: str) -> None:
        await self.until(f"return document.body.dataset.state === {json.dumps(state)}")

    async def load(self) -> None:
        await threads.deferToThread(self.driver.get, self.relay.url + "/viewer")

    async def type_token(self, token: str) -> None:
        def type_it() -> None:
            from selenium.webdriver.common.by import By

            self.driver.find_element(By.ID, "token").send_keys(token)
            self.driver.find_element(By.ID, "connect").click()

        await threads.deferToThread(type_it)

    async def open_live(self) -> None:
        """Load the viewer, give it the token, and wait for its stream."""
        await self.load()
        await self.until_state("token")
        await self.type_token(TOKEN)
        await self.until_state("live")

    async def click(self, element_id: str) -> None:
        await self.js("document.getElementById(arguments[0]).click()", element_id)

    async def post(self, *events: dict[str, Any]) -> None:
        response, body = await self.relay.post(*events, token=TOKEN)
        self.assertEqual(response.code, 202, body)

    async def rows(self) -> list[dict[str, Any]]:
        """The events shown, top (newest) first."""
        return await self.js(  # type: ignore[no-any-return]
            """return [...document.querySelectorAll('#events li.event')].map(r => ({
                 position: r.dataset.position || null,
                 type: r.querySelector('.type').textContent,
                 session: r.querySelector('.session').textContent,
                 agent: r.querySelector('.agent').textContent}))"""
        )

    async def positions(self) -> list[str]:
        return [row["position"] for row in await self.rows()]

    async def until_shown(self, position: str) -> None:
        selector = f"#events li[data-position={json.dumps(position)}]"
        await self.until(f"return document.querySelector({json.dumps(selector)}) !== null")

    async def browser_errors(self) -> list[str]:
        log = await threads.deferToThread(self.driver.get_log, "browser")
        return [entry["message"] for entry in log if entry["level"] == "SEVERE" and "favicon" not in entry["message"]]


class TokenAndLiveEvents(ViewerCase):
    async def test_asks_for_the_token_then_shows_an_event_posted_after_loading(self) -> None:
        await self.load()
        await self.until_state("token")
        self.assertEqual(await self.js("return document.getElementById('token-form').hidden"), False)
        self.assertEqual(await self.js("return document.getElementById('token-reason').textContent"), "This relay needs a token.")
        await self.type_token("not-the-token")
        await self.until("return document.getElementById('token-reason').textContent.includes('refused')")
        await self.until_state("token")
        await self.type_token(TOKEN)
        await self.until_state("live")
        self.assertEqual(await self.js("return sessionStorage.getItem('relayd.aep.token')"), TOKEN)
        self.assertEqual(await self.rows(), [])
        await self.post(event("S1", 0, agent="agent-1", data={"n": 1}))
        await self.until_shown("S1:0:0")
        self.assertEqual(await self.rows(), [{"position": "S1:0:0", "type": "session.started", "session": "S1", "agent": "agent-1"}])
        self.assertEqual(await self.js("return document.querySelector('#events .seq').textContent"), "0")
        self.assertEqual(await self.js("return document.querySelector('#events .time').textContent"), "2026-11-29T00:00:00Z")
        self.assertEqual(await self.js("return document.querySelector('#sessions .name').textContent"), "S1")
        # The payload, pretty-printed on demand.
        self.assertEqual(await self.js("return document.querySelector('#events .payload').hidden"), True)
        await self.js("document.querySelector('#events .summary').click()")
        payload = await self.js("return document.querySelector('#events .payload').textContent")
        self.assertIn('"data": {\n    "n": 1\n  }', payload)
        # The tab keeps the token: a reload reads the stream at once.
        await self.load()
        await self.until_state("live")
        await self.post(event("S1", 1))
        await self.until_shown("S1:0:1")
        # The browser logs the two 401s the page asked for the token on, nothing else.
        errors = await self.browser_errors()
        self.assertEqual(len(errors), 2, errors)
        self.assertTrue(all(e.endswith("/stream - Failed to load resource: the server responded with a status of 401 (Unauthorized)") for e in errors), errors)


class WithoutToken(ViewerCase):
    relay_token = None

    async def test_a_relay_without_a_token_is_read_at_once(self) -> None:
        await self.load()
        await self.until_state("live")
        self.assertEqual(await self.js("return [document.getElementById('token-form').hidden, document.getElementById('forget').hidden]"), [True, True])
        response, body = await self.relay.post(event("S", 0))
        self.assertEqual(response.code, 202, body)
        await self.until_shown("S:0:0")
        self.assertEqual(await self.browser_errors(), [])


class Filters(ViewerCase):
    async def apply(self, session: str = "", agent: str = "", type: str = "") -> None:
        await self.js(
            """document.getElementById('filter-session').value = arguments[0];
               document.getElementById('filter-agent').value = arguments[1];
               document.getElementById('filter-type').value = arguments[2];
               document.getElementById('apply').click();""",
            session, agent, type,
        )
        await self.until_state("live")

    async def test_only_events_the_filter_matches_are_shown(self) -> None:
        await self.open_live()
        await self.apply(session="A")
        self.assertEqual(await self.js("return document.getElementById('filter-json').textContent"), '{"session":"A"}')
        await self.post(event("B", 0), event("A", 0))  # in this order: B would be shown before A
        await self.until_shown("A:0:0")
        self.assertEqual(await self.positions(), ["A:0:0"])

        await self.apply(type="x.viewer.*")
        await self.post(event("A", 1), event("C", 0, type="x.viewer.kept"))
        await self.until_shown("C:0:0")
        self.assertEqual(await self.positions(), ["C:0:0"])

        await self.apply(agent="b, c")
        await self.post(event("D", 0, agent="a"), event("D", 1, agent="c"))
        await self.until_shown("D:0:1")
        self.assertEqual(await self.positions(), ["D:0:1"])
        self.assertEqual(await self.js("return document.getElementById('filter-json').textContent"), '{"agent":["b","c"]}')

    async def test_a_filter_the_relay_refuses_is_reported(self) -> None:
        await self.open_live()
        await self.apply(session="A")
        # A glob is only for types: the relay's 400 message is shown, and nothing is retried.
        await self.js(
            "document.getElementById('filter-session').value = ''; document.getElementById('filter-agent').value = 'a.*';"
            "document.getElementById('apply').click()"
        )
        await self.until_state("refused")
        status = await self.js("return document.getElementById('status').textContent")
        self.assertTrue(status.startswith("refused (400): "), status)


class PauseAndResume(ViewerCase):
    async def test_events_posted_while_paused_appear_once_after_resume(self) -> None:
        await self.open_live()
        await self.post(event("S", 0), event("S", 1), event("T", 0))
        await self.until_shown("T:0:0")
        await self.click("pause")
        await self.until_state("paused")
        await self.post(event("S", 2), event("T", 1), event("S", 3))
        await self.click("pause")  # now "Resume"
        await self.until_state("live")
        await self.until_shown("S:0:3")
        # One more live event: anything the resume repeated would be shown before it.
        await self.post(event("T", 2))
        await self.until_shown("T:0:2")
        shown = await self.positions()
        self.assertEqual(sorted(shown), ["S:0:0", "S:0:1", "S:0:2", "S:0:3", "T:0:0", "T:0:1", "T:0:2"])
        # Each session's events in order, newest at the top (the resume replays one session after the other).
        self.assertEqual([p for p in shown if p.startswith("S:")], ["S:0:3", "S:0:2", "S:0:1", "S:0:0"])
        self.assertEqual([p for p in shown if p.startswith("T:")], ["T:0:2", "T:0:1", "T:0:0"])
        self.assertEqual(await self.js("return document.getElementById('gaps').textContent"), "0")


class History(ViewerCase):
    async def test_replay_from_history_shows_earlier_events(self) -> None:
        await self.post(event("old", 0), event("old", 1, type="x.viewer.thing"))
        await self.open_live()
        await self.post(event("new", 0))
        await self.until_shown("new:0:0")
        self.assertEqual(await self.positions(), ["new:0:0"])  # live only until asked
        await self.click("replay")
        await self.until_shown("old:0:1")
        await self.until_shown("new:0:0")
        self.assertEqual(sorted(await self.positions()), ["new:0:0", "old:0:0", "old:0:1"])
        self.assertEqual((await self.positions()).index("old:0:1"), (await self.positions()).index("old:0:0") - 1)


class Gaps(ViewerCase):
    relay_flags = {"aep_buffer": 2}

    async def test_a_replay_exhausted_gap_is_counted_once(self) -> None:
        await self.open_live()
        await self.post(event("S", 0))
        await self.until_shown("S:0:0")
        await self.click("pause")
        await self.until_state("paused")
        # The relay keeps two events of S: 1 and 2 are gone by the time the viewer resumes.
        await self.post(event("S", 1), event("S", 2), event("S", 3), event("S", 4))
        await self.click("pause")
        await self.until_shown("S:0:4")
        self.assertEqual(await self.positions(), ["S:0:4", "S:0:3", "S:0:0"])
        self.assertEqual(await self.js("return document.getElementById('gaps').textContent"), "1")
        marker = await self.js("return document.querySelector('#events li.marker').textContent")
        self.assertIn("session S", marker)
        self.assertIn("earliest is 0:3", marker)

    async def test_a_jump_in_a_sessions_seq_is_counted(self) -> None:
        await self.open_live()
        await self.post(event("S", 0), event("S", 1), event("S", 5))  # as a consumer the relay skipped for
        await self.until_shown("S:0:5")
        self.assertEqual(await self.js("return document.getElementById('gaps').textContent"), "1")


class ResumeOfManySessions(ViewerCase):
    async def test_sessions_beyond_one_request_are_counted_as_gaps_not_retried(self) -> None:
        # 60 sessions of 200 characters: their resume positions would make a request head over the
        # relay's 16 KiB (a 431, again at every retry); the viewer resumes those shown last.
        names = [f"{i:03d}-" + "s" * 196 for i in range(60)]
        costs = [len(quote(json.dumps({"session": n, "epoch": 0, "seq": 0}, separators=(",", ":")), safe="-_.!~*'()")) + 3 for n in names]
        fit = 0
        while sum(costs[len(costs) - fit - 1 :]) <= 12000:
            fit += 1
        left = len(names) - fit
        self.assertTrue(0 < left < len(names))
        await self.open_live()
        await self.post(*(event(name, 0) for name in names))
        await self.until_shown(f"{names[-1]}:0:0")
        await self.click("pause")
        await self.until_state("paused")
        await self.post(*(event(name, 1) for name in names))
        await self.click("pause")
        await self.until_state("live")
        await self.until_shown(f"{names[-1]}:0:1")
        await self.post(event(names[0], 2))  # a session left out is shown again from its next event
        await self.until_shown(f"{names[0]}:0:2")
        resumed = sorted(p for p in await self.positions() if p.endswith(":0:1"))
        self.assertEqual(resumed, [f"{name}:0:1" for name in names[left:]])
        self.assertEqual(await self.js("return document.getElementById('gaps').textContent"), str(left))
        marker = await self.js("return document.querySelector('#events li.marker').textContent")
        self.assertIn(f"the {left} sessions shown least recently are not resumed", marker)


class MarkupIsText(ViewerCase):
    async def test_markup_in_an_event_is_shown_as_text(self) -> None:
        markup = "<img src=x onerror=window.pwned=1>"
        await self.open_live()
        await self.post(event(markup, 0, agent="<b>agent</b>", data={"text": markup}))
        await self.until("return document.querySelector('#events li.event') !== null")
        await self.js("document.querySelector('#events .summary').click()")
        row = (await self.rows())[0]
        self.assertEqual((row["session"], row["agent"]), (markup, "<b>agent</b>"))
        payload = await self.js("return document.querySelector('#events .payload').textContent")
        self.assertIn(f'"text": "{markup}"', payload)
        self.assertEqual(await self.js("return document.querySelectorAll('img, b:not(nav b)').length"), 0)
        self.assertEqual(await self.js("return document.querySelector('#sessions .name').textContent"), markup)
        self.assertIsNone(await self.js("return window.pwned === undefined ? null : window.pwned"))
        self.assertEqual([m for m in await self.browser_errors() if re.search("Content Security Policy", m)], [])
