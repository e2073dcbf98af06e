"""What the per-address bounds of the MCP wing count (--mcp-max-sessions-per-address,
--mcp-max-clients-per-address): one IPv4 address, or one IPv6 /64.

An IPv6 host is routinely given a whole /64 (SLAAC, privacy addresses), so a holder of one could
rotate through 2**64 addresses and evade any per-address bound; its /64 is what one holder has.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache


@lru_cache(maxsize=4096)
def bound_key(address: str) -> str:
    """The key a client address is counted under: an IPv4 address as it is (an IPv4-mapped IPv6 one
    as its IPv4 address), an IPv6 one as its /64 (C{2001:db8:1:2::/64}); anything else unchanged
    (C{""}: unknown)."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.partition("%")[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
