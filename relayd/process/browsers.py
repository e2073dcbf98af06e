"""Which browsers a relay answers: the C{Host} and C{Origin} a request may carry, and its CORS headers.

A relay with no credential of its own (AEP without C{--aep-token}) is open to any page the user
opens: a cross-site page can send it requests (C{Origin} names that page), and a page on a name
the attacker's DNS points at 127.0.0.1 (DNS rebinding) can even read the answers (C{Host} names
that page's host). Local services check both (Jupyter, Ollama, a browser's DevTools port; the MCP
specification asks local servers to validate C{Origin}), and so does relayd: by default only
loopback names (C{localhost}, C{*.localhost}, C{127.0.0.0/8}, C{[::1]}, any port) pass;
C{--allow-host} and C{--allow-origin} widen that (C{*}: any).

A request without C{Origin} (curl, an SDK, a same-origin navigation) is judged by its C{Host}
alone; one without C{Host} (HTTP/1.0) has nothing to judge. CORS follows the same policy:
C{access-control-allow-origin: *} only with C{--allow-origin '*'}, else the request's allowed
origin echoed with C{Vary: Origin}.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Final, Sequence
from urllib.parse import urlsplit

from relayd.process.cors import CorsPolicyError, OriginPolicy, parse_origins

Header = tuple[bytes, bytes]

ALLOW_HOST_FLAG: Final = "--allow-host (env RELAYD_ALLOW_HOST)"
ALLOW_ORIGIN_FLAG: Final = "--allow-origin (env RELAYD_ALLOW_ORIGIN)"
_VARY: Final = (b"vary", b"Origin")
_ANY: Final = (b"access-control-allow-origin", b"*")
# Host values seen and their verdicts, kept so a request does not parse its Host again; bounded,
# since an attacker chooses them (a full cache is cleared and refilled).
_CACHE_SIZE: Final = 256
_LISTED_ONLY: Final = OriginPolicy(any=False)  # no origin but the loopback ones


def is_loopback_name(host: str) -> bool:
    """C{localhost}, a name under C{.localhost} (RFC 6761: always loopback), C{127.0.0.0/8} or C{::1}."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str | None:
    """The host of a C{Host} header or of an origin's authority, lower-cased, without its port and
    an IPv6 literal's brackets; C{None} when C{value} is not C{host[:port]}."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1 :]
        if end < 0 or ":" not in host:
            return None
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
        if not host or any(c in host for c in "/@?#[] \\"):
            return None
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and rest[1:].isascii()):
        return None
    return host


def host_entry(text: str) -> str:
    """One C{--allow-host} value: C{*} or a comma list of host names or addresses (no port: any port
    matches); validated on its own, combined later (L{parse_hosts})."""
    parse_hosts([text])
    return text


def parse_hosts(values: Sequence[str]) -> tuple[bool, frozenset[str]]:
    """C{(any, names)} from C{--allow-host} values (each C{*} or a comma list).

    @raise ValueError: an entry that is not a host name or address, or C{*} mixed with names.
    """
    entries = [e.strip() for value in values for e in value.split(",")]
    entries = [e for e in entries if e]
    if "*" in entries:
        if any(e != "*" for e in entries):
            raise ValueError("* (any host) cannot be combined with host names")
        return True, frozenset()
    names = set()
    for entry in entries:
        name = host_name(entry)
        if name is None or name != entry.lower().strip("[]"):
            raise ValueError(f'"{entry}" is not a host name or address (give it without scheme, port or path)')
        names.add(name)
    return False, frozenset(names)


def origin_entry(text: str) -> str:
    """One C{--allow-origin} value: C{*} or a comma list of origins; validated on its own."""
    try:
        parse_origins(text)
    except CorsPolicyError as e:
        raise ValueError(str(e)) from None
    return text


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the header at fault and the flag that would allow it."""

    header: str
    flag: str

    def body(self) -> dict[str, str]:
        """The JSON body of the C{403}."""
        return {
            "error": f"{self.header.lower()}-not-allowed",
            "header": self.header,
            "detail": f"this {self.header} is not allowed: without a token relayd answers loopback names "
            f"only; add it with {self.flag}, or set a token",
        }


HOST_REFUSED: Final = Refusal("Host", ALLOW_HOST_FLAG)
ORIGIN_REFUSED: Final = Refusal("Origin", ALLOW_ORIGIN_FLAG)


@dataclass(frozen=True)
class BrowserPolicy:
    """The hosts and origins a relay answers besides the loopback ones (module docstring).

    @ivar any_host: C{--allow-host '*'}: every C{Host} passes.
    @ivar hosts: the other host names allowed, lower-cased, any port.
    @ivar origins: C{--allow-origin}: C{*} (every origin passes, and CORS says C{*}) or the listed ones.
    """

    any_host: bool = False
    hosts: frozenset[str] = frozenset()
    origins: OriginPolicy = _LISTED_ONLY
    _host_verdicts: dict[bytes, bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_values(cls, hosts: Sequence[str] = (), origins: Sequence[str] = ()) -> BrowserPolicy:
        """The policy of the C{--allow-host} and C{--allow-origin} values (each validated already)."""
        any_host, names = parse_hosts(hosts)
        policy = parse_origins(list(origins)) if origins else _LISTED_ONLY
        return cls(any_host=any_host, hosts=names, origins=policy)

    def describe(self) -> str:
        """What the startup line says: the hosts and origins allowed besides loopback."""
        hosts = "*" if self.any_host else ",".join(["loopback", *sorted(self.hosts)])
        origins = "*" if self.origins.any else ",".join(["loopback", *self.origins.origins])
        return f"hosts {hosts}, origins {origins}"

    def host_allowed(self, value: bytes | None) -> bool:
        """Whether a request with C{Host: value} (or none) is answered."""
        if value is None or self.any_host:
            return True
        verdict = self._host_verdicts.get(value)
        if verdict is None:
            name = host_name(value.decode("latin-1"))
            verdict = name is not None and (is_loopback_name(name) or name in self.hosts)
            if len(self._host_verdicts) >= _CACHE_SIZE:
                self._host_verdicts.clear()
            self._host_verdicts[value] = verdict
        return verdict

    def origin_allowed(self, value: bytes | None) -> bool:
        """Whether a request with C{Origin: value} (or none) is answered (C{null} never is)."""
        if value is None or self.origins.allows(value):
            return True
        try:
            text = value.decode("ascii")
            parts = urlsplit(text)
        except (UnicodeDecodeError, ValueError):
            return False
        if parts.scheme not in ("http", "https") or text != f"{parts.scheme}://{parts.netloc}":
            return False  # not an origin as a browser serialises one (no path, query or fragment)
        name = host_name(parts.netloc)
        return name is not None and is_loopback_name(name)

    def refusal(self, host: bytes | None, origin: bytes | None) -> Refusal | None:
        """Why a request with these C{Host} and C{Origin} values is refused, or C{None}."""
        if not self.host_allowed(host):
            return HOST_REFUSED
        if not self.origin_allowed(origin):
            return ORIGIN_REFUSED
        return None

    def cors(self, origin: bytes | None) -> tuple[Header, ...]:
        """The C{access-control-allow-origin} (and C{vary}) of an answer to C{Origin: origin}."""
        if self.origins.any:
            return (_ANY,)
        if origin is not None and self.origin_allowed(origin):
            return ((b"access-control-allow-origin", origin), _VARY)
        return (_VARY,)


LOOPBACK_ONLY: Final = BrowserPolicy()
"""The default: loopback hosts and origins only."""
