"""Origin policy parsing (mcp-relay.md §6.2, O1-O10) and per-request headers (§6.1)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.process.cors import ANY_ORIGIN, CorsPolicyError, OriginPolicy, normalise_origin, parse_origins
from tests.support.cases import cases, expand


@expand
class CORSPolicyTests(TestCase):
    def test_o1_star_means_any(self) -> None:
        assert parse_origins("*") == ANY_ORIGIN
        assert parse_origins(" * ").any

    def test_o2_comma_list(self) -> None:
        assert parse_origins("https://a.example,https://b.example").origins == ("https://a.example", "https://b.example")

    def test_o3_array(self) -> None:
        assert parse_origins(["https://a.example", "https://b.example"]).origins == ("https://a.example", "https://b.example")

    def test_o4_normalised(self) -> None:
        policy = parse_origins("HTTPS://Particle.Academy:443/, http://localhost:5173")
        assert policy.origins == ("https://particle.academy", "http://localhost:5173")

    def test_o5_non_default_port_kept(self) -> None:
        assert parse_origins("https://a.example:8443").origins == ("https://a.example:8443",)

    def test_o6_empty_entries_and_duplicates_dropped(self) -> None:
        assert parse_origins("https://a.example,, https://a.example/ ,").origins == ("https://a.example",)

    def test_o7_star_mixed_refused(self) -> None:
        with self.assertRaises(CorsPolicyError, match=r"\*"):
            parse_origins("*,https://a.example")
        with self.assertRaises(CorsPolicyError, match=r"\*"):
            parse_origins(["*", "https://a.example"])

    @cases(*["", " , ", []])
    def test_o8_empty_refused(self, value: object) -> None:
        with self.assertRaises(CorsPolicyError, match=re.compile("empty|no origin", re.I)):
            parse_origins(value)  # type: ignore[arg-type]

    @cases(*["null", "NULL", "https://a.example,null"])
    def test_o9_null_refused(self, value: str) -> None:
        with self.assertRaises(CorsPolicyError, match="null"):
            parse_origins(value)

    def test_o10_not_an_origin_or_has_path(self) -> None:
        with self.assertRaises(CorsPolicyError, match=re.compile("origin", re.I)):
            parse_origins("particle.academy")
        with self.assertRaises(CorsPolicyError, match=re.compile("path", re.I)):
            parse_origins("https://a.example/app")

    @cases(*["https://u:p@a.example", "https://a.example?q=1", "https://a.example#f", "https://", "https://a.example:99999"])
    def test_other_refusals(self, entry: str) -> None:
        with self.assertRaises(CorsPolicyError):
            parse_origins(entry)

    @cases(*[
        ("http://A.Example:80", "http://a.example"),
        ("wss://a.example:443/", "wss://a.example"),
        ("http://[::1]:8080", "http://[::1]:8080"),
        ("chrome-extension://abcdef", "chrome-extension://abcdef"),
        ("http://bücher.example", "http://xn--bcher-kva.example"),
    ])
    def test_normalisation(self, entry: str, expected: str) -> None:
        assert normalise_origin(entry) == expected


def _headers(policy: OriginPolicy, origin: bytes | None) -> dict[bytes, bytes]:
    return dict(policy.headers(origin))


@expand
class CORSHeaderTests(TestCase):
    def test_star_policy_headers(self) -> None:
        h = _headers(ANY_ORIGIN, b"https://x.example")
        assert h[b"access-control-allow-origin"] == b"*"
        assert b"vary" not in h
        assert h[b"access-control-allow-methods"] == b"GET, POST, OPTIONS"
        assert h[b"access-control-allow-headers"] == b"content-type, x-csrf-token, accept, authorization"
        assert h[b"access-control-max-age"] == b"86400"
        assert b"access-control-allow-credentials" not in h

    def test_list_policy_headers(self) -> None:
        policy = parse_origins("https://a.example")
        assert _headers(policy, b"https://a.example")[b"access-control-allow-origin"] == b"https://a.example"
        for origin in (b"https://evil.example", b"null", None, b"HTTPS://A.EXAMPLE", b"https://a.example/"):
            h = _headers(policy, origin)
            assert b"access-control-allow-origin" not in h, origin  # never null, never a guess
            assert h[b"vary"] == b"Origin"

    @given(st.lists(st.sampled_from(["https://a.example", "HTTP://B.example:80/", " https://c.example:8443 ", ""]), min_size=1))
    def test_parse_is_idempotent_on_its_output(self, entries: list[str]) -> None:
        try:
            policy = parse_origins(entries)
        except CorsPolicyError:
            assert not any(e.strip() for e in entries)
            return
        assert parse_origins(list(policy.origins)) == policy
