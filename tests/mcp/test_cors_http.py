"""CORS over HTTP (mcp-relay.md §9 H1-H13, adapted to relayd's --mcp-cors / env settings),
on the MCP wing served in memory (tests/support/inmemory.py)."""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial import unittest

from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, resolve
from relayd.mcp.config import SETTINGS
from relayd.mcp.service import make_service
from tests.support.inmemory import InMemoryMcpCase
from tests.support.mcp import TOKEN

PA = "https://particle.academy"
WWW = "https://www.particle.academy"


class ListPolicyTests(InMemoryMcpCase):
    flags = {"mcp-cors": [f"{PA},{WWW}"]}

    def test_h1_preflight_echoes_listed_origin(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": WWW})
        self.assertEqual(reply.code, 204)
        self.assertEqual(reply.header("access-control-allow-origin"), WWW)

    def test_h2_post_echoes_listed_origin(self) -> None:
        reply = self.post("/register", {"session": "sess", "token": TOKEN}, origin=PA)
        self.assertEqual(reply.code, 200)
        self.assertEqual(reply.header("access-control-allow-origin"), PA)

    def test_h3_vary_origin(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": PA})
        self.assertIn("origin", (reply.header("vary") or "").lower())

    def test_h4_unlisted_gets_no_allow_origin_but_vary(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://evil.example"})
        self.assertIsNone(reply.header("access-control-allow-origin"))
        self.assertIn("origin", (reply.header("vary") or "").lower())
        no_origin = self.request("OPTIONS", "/register")
        self.assertIsNone(no_origin.header("access-control-allow-origin"))
        self.assertIn("origin", (no_origin.header("vary") or "").lower())

    def test_h5_null_origin_never_matched(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "null"})
        self.assertIsNone(reply.header("access-control-allow-origin"))

    def test_h7_inbox_poll_and_events_echo(self) -> None:
        self.register()
        inbox = self.post(f"/sess/inbox?token={TOKEN}", raw=b'{"jsonrpc":"2.0","method":"n"}', origin=WWW)
        self.assertEqual((inbox.code, inbox.header("access-control-allow-origin")), (200, WWW))
        poll = self.request("GET", f"/sess/poll?token={TOKEN}&wait=0", headers={"origin": PA})
        self.assertEqual((poll.code, poll.header("access-control-allow-origin")), (200, PA))
        stream = self.events(origin=PA).head()
        self.assertEqual(stream.header("access-control-allow-origin"), PA)
        self.assertEqual(stream.header("vary"), "Origin")
        gone = self.request("GET", f"/gone/poll?token={TOKEN}&wait=0", headers={"origin": PA})
        self.assertEqual((gone.code, gone.header("access-control-allow-origin")), (410, PA))


class NormalisedListTests(InMemoryMcpCase):
    flags = {"mcp-cors": ["https://a.example/ ,  https://b.example"]}

    def test_h6_both_normalised_origins_echo(self) -> None:
        for origin in ("https://a.example", "https://b.example"):
            reply = self.request("OPTIONS", "/register", headers={"origin": origin})
            self.assertEqual(reply.header("access-control-allow-origin"), origin)


class DefaultPolicyTests(InMemoryMcpCase):
    def test_h8_default_is_star(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://any.example"})
        self.assertEqual(reply.header("access-control-allow-origin"), "*")
        self.assertIsNone(reply.header("vary"))


class ExplicitStarTests(InMemoryMcpCase):
    flags = {"mcp-cors": ["*"]}

    def test_h9_explicit_star(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://any.example"})
        self.assertEqual(reply.header("access-control-allow-origin"), "*")


class RepeatedFlagTests(InMemoryMcpCase):
    flags = {"mcp-cors": ["https://a.example", "https://b.example"]}

    def test_h11_repeated_flag_list_echoes_with_vary(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://b.example"})
        self.assertEqual(reply.header("access-control-allow-origin"), "https://b.example")
        self.assertEqual(reply.header("vary"), "Origin")

    def test_h12_unlisted_gets_nothing(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://c.example"})
        self.assertIsNone(reply.header("access-control-allow-origin"))


class FlagOverEnvTests(InMemoryMcpCase):
    flags = {"mcp-cors": ["https://a.example"]}
    environ = {"CORS_ALLOW_ORIGIN": "*"}

    def test_h13_list_flag_wins_over_star_env(self) -> None:
        reply = self.request("OPTIONS", "/register", headers={"origin": "https://c.example"})
        self.assertIsNone(reply.header("access-control-allow-origin"))


class StarMixedWithOriginsTests(unittest.TestCase):
    """H10: no relay is built from a CORS list that mixes * with origins."""

    def test_h10_star_mixed_with_origins_refused_at_startup(self) -> None:
        for flags in ({"mcp-cors": ["*,https://a.example"]}, {"mcp-cors": ["*", "https://a.example"]}):
            try:
                settings = resolve(SETTINGS, flags, {})
                make_service(settings, reactor, Timekeeper(reactor))
            except ConfigError as e:
                self.assertIn("*", str(e))
                self.assertIn("--mcp-cors", str(e))
            else:
                self.fail(f"{flags} was accepted")
