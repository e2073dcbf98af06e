"""What the per-address bounds count: an IPv4 address, an IPv6 /64."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relayd.mcp.core.addresses import bound_key


class BoundKey(SynchronousTestCase):
    def test_ipv4_counts_by_itself(self) -> None:
        self.assertEqual(bound_key("203.0.113.7"), "203.0.113.7")
        self.assertNotEqual(bound_key("203.0.113.7"), bound_key("203.0.113.8"))

    def test_ipv6_counts_by_its_64(self) -> None:
        self.assertEqual(bound_key("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), "2001:db8:1:2::/64")
        self.assertEqual(bound_key("2001:db8:1:2::1"), bound_key("2001:db8:1:2:ffff:ffff:ffff:ffff"))
        self.assertNotEqual(bound_key("2001:db8:1:2::1"), bound_key("2001:db8:1:3::1"))
        self.assertEqual(bound_key("::1"), "::/64")
        self.assertEqual(bound_key("fe80::1%eth0"), "fe80::/64")

    def test_ipv4_mapped_counts_as_its_ipv4_address(self) -> None:
        self.assertEqual(bound_key("::ffff:203.0.113.7"), "203.0.113.7")

    def test_unknown_and_unparsable_are_kept(self) -> None:
        self.assertEqual(bound_key(""), "")
        self.assertEqual(bound_key("not:an:address:x"), "not:an:address:x")
