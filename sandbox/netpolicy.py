"""The `allowlist` / `open` network policies: which destinations the egress proxy may reach.

A policy is a list of entries, each `DEST[:PORTS]`:
- `pypi.org`            one hostname (ports 80 and 443 when none are given)
- `*.pythonhosted.org`  a wildcard domain: the domain itself and every name below it
- `10.1.2.3`, `10.0.0.0/8`, `[::1]`  an address or a network (IPv6 in brackets with a port)
- `127.0.0.1:8080`, `example.com:80,443,8000-8010`  explicit ports (ranges allowed)

What no entry unlocks by name: FORBIDDEN_NETS (loopback, private ranges, link-local and
cloud metadata, CGNAT, multicast, IPv6 forms that embed an IPv4 address). A destination in
them is refused *after resolution*, so an allowed name that resolves to 127.0.0.1 or
169.254.169.254 is refused too; only an entry that names the address itself (an IP or a
CIDR) lifts that, for exactly that network. `open` allows every name and port, still with
the forbidden networks refused and every request recorded.

The proxy (squid) enforces this: `squid_rules` renders the policy as squid ACLs. The same
policy is evaluated here again (`explain`) to name the rule behind each logged request.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PORTS: tuple[tuple[int, int], ...] = ((80, 80), (443, 443))
MAX_ENTRIES = 256
FORBIDDEN_NETS: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::/128",
    "::1/128",
    # not "::ffff:0:0/96": squid keeps IPv4 addresses in that mapped form, so to it the
    # entry means every IPv4 address; mapped addresses are checked as the IPv4 they carry
    "64:ff9b::/96",
    "2002::/16",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
)
_NAME = re.compile(r"^(\*\.)?([a-z0-9_]([a-z0-9_-]{0,62})?)(\.[a-z0-9_]([a-z0-9_-]{0,62})?)*\.?$")

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


class PolicyError(ValueError):
    """An allowlist entry that cannot be understood (the message names it)."""


@dataclass(frozen=True)
class Entry:
    """One allowlist entry: a name, a wildcard domain or a network, and its ports."""

    text: str
    name: str | None = None  # lower-case, no trailing dot
    wildcard: bool = False
    net: Net | None = None
    ports: tuple[tuple[int, int], ...] = DEFAULT_PORTS

    def matches_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        if self.net is not None:
            addr = _address(host)
            return addr is not None and addr in self.net
        assert self.name is not None
        return host == self.name or (self.wildcard and host.endswith("." + self.name))

    def matches_port(self, port: int) -> bool:
        return any(lo <= port <= hi for lo, hi in self.ports)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _ports(text: str, entry: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise PolicyError(
                f"allowlist entry {entry!r}: {part!r} is not a port or a range"
            ) from None
        if not (1 <= a <= b <= 65535):
            raise PolicyError(f"allowlist entry {entry!r}: port range {part!r} is outside 1-65535")
        out.append((a, b))
    return tuple(out)


def parse_entry(text: str) -> Entry:
    """One `DEST[:PORTS]` entry, or PolicyError naming it."""
    raw = text.strip()
    if not raw or len(raw) > 300:
        raise PolicyError(f"allowlist entry {text[:80]!r}: empty or longer than 300 characters")
    dest, ports = raw, ""
    if raw.startswith("["):  # [v6] or [v6]:ports or [v6/len]:ports
        end = raw.find("]")
        if end < 0:
            raise PolicyError(f"allowlist entry {raw!r}: '[' without ']'")
        dest, rest = raw[1:end], raw[end + 1 :]
        if rest and not rest.startswith(":"):
            raise PolicyError(f"allowlist entry {raw!r}: expected ':PORTS' after ']'")
        ports = rest[1:]
    elif raw.count(":") == 1:
        dest, ports = raw.split(":")
    elif raw.count(":") > 1:  # a bare IPv6 address or network, no ports
        dest = raw
    port_ranges = _ports(ports, raw) if ports else DEFAULT_PORTS
    try:
        net = ipaddress.ip_network(dest, strict=False)
    except ValueError:
        net = None
    if net is not None:
        return Entry(raw, net=net, ports=port_ranges)
    name = dest.lower().rstrip(".")
    if not _NAME.match(name) or len(name) > 253:
        raise PolicyError(
            f"allowlist entry {raw!r}: not a hostname, '*.domain', IP address or CIDR "
            "(write DEST or DEST:PORTS, e.g. pypi.org, *.pythonhosted.org:443, 10.0.0.0/8:80)"
        )
    wildcard = name.startswith("*.")
    return Entry(raw, name=name[2:] if wildcard else name, wildcard=wildcard, ports=port_ranges)


@dataclass(frozen=True)
class EgressPolicy:
    """What one sandbox may reach through the proxy ("allowlist" or "open")."""

    mode: str  # "allowlist" | "open"
    entries: tuple[Entry, ...] = ()

    @classmethod
    def build(cls, mode: str, allow: list[str] | tuple[str, ...]) -> EgressPolicy:
        if mode not in ("allowlist", "open"):
            raise PolicyError(
                f"network policy {mode!r}: the egress proxy serves 'allowlist' or 'open'"
            )
        if len(allow) > MAX_ENTRIES:
            raise PolicyError(f"allowlist: {len(allow)} entries, at most {MAX_ENTRIES}")
        return cls(mode, tuple(parse_entry(a) for a in allow))

    @property
    def key(self) -> str:
        """A short stable id: sandboxes with the same policy share one proxy and network."""
        text = self.mode + "\n" + "\n".join(sorted(e.text for e in self.entries))
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def listed_nets(self) -> list[Net]:
        return [e.net for e in self.entries if e.net is not None]

    def explain(self, host: str, port: int, allowed: bool) -> str:
        """The rule behind a logged decision (the proxy applied the same rules in this order)."""
        addr = _address(host)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        forbidden = [ipaddress.ip_network(n) for n in FORBIDDEN_NETS]
        listed = self.listed_nets()
        if (
            addr is not None
            and any(addr in n for n in forbidden)
            and not any(addr in n for n in listed)
        ):
            return "deny: forbidden address " + next(str(n) for n in forbidden if addr in n)
        if self.mode == "open":
            return "allow: open" if allowed else "deny: forbidden address after resolution"
        for e in self.entries:
            if e.matches_host(host) and e.matches_port(port):
                return (
                    f"allow: {e.text}"
                    if allowed
                    else f"deny: {e.text} resolves to a forbidden address"
                )
        if any(e.matches_host(host) for e in self.entries):
            return f"deny: port {port} not allowed for {host}"
        return "deny: not in allowlist"


NETWORK_MODES = ("none", "bridge", "host", "allowlist", "open")
NETWORK_SYNTAX = (
    "none | open | bridge | host | allowlist:ENTRIES, e.g. 'allowlist:pypi.org "
    "*.pythonhosted.org:443' (entries: a hostname, *.domain, an IP or CIDR, each optionally "
    ":PORTS such as 443, 80,443 or 8000-8010; separated by spaces or ';')"
)


def parse_network(spec: str) -> tuple[str, tuple[str, ...]]:
    """One network-policy string (a flag, SANDFLOW_NETWORK, a config file, a task's
    metadata) as (mode, allowlist entries), every entry checked; PolicyError names what is
    wrong. The one parser of the syntax `SandboxLimits(network=...)` also accepts."""
    text = spec.strip()
    mode, sep, rest = text.partition(":")
    mode = mode.strip()
    if mode not in NETWORK_MODES:
        raise PolicyError(
            f"network {spec[:120]!r}: unknown policy {mode[:40]!r}; use {NETWORK_SYNTAX}"
        )
    entries = tuple(e for e in rest.replace(";", " ").split() if e)
    if sep and mode != "allowlist":
        raise PolicyError(
            f"network {spec[:120]!r}: only 'allowlist' takes entries after ':' ({mode!r} does not)"
        )
    if mode == "allowlist" and not entries:
        raise PolicyError(
            f"network {spec[:120]!r}: name what the allowlist lets through, e.g. "
            "'allowlist:pypi.org *.pythonhosted.org:443'"
        )
    if mode in ("allowlist", "open"):
        EgressPolicy.build(mode, entries)
    return mode, entries


def squid_rules(policy: EgressPolicy) -> str:
    """The policy as squid `acl` / `http_access` lines (first match wins)."""
    # squid's cache manager (its own URLs) is no sandbox's business, whatever the mode
    lines = ["acl CONNECT method CONNECT", "http_access deny manager"]
    lines.append("acl sf_forbidden dst " + " ".join(FORBIDDEN_NETS))
    listed = policy.listed_nets()
    if listed:
        lines.append("acl sf_listed dst " + " ".join(str(n) for n in listed))
        lines.append("http_access deny sf_forbidden !sf_listed")
    else:
        lines.append("http_access deny sf_forbidden")
    if policy.mode == "open":
        lines.append("http_access allow all")
        return "\n".join(lines) + "\n"
    for i, e in enumerate(policy.entries):
        ports = " ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in e.ports)
        lines.append(f"acl sf_p{i} port {ports}")
        if e.net is not None:
            lines.append(f"acl sf_d{i} dst {e.net}")
        else:
            # a literal name is dstdomain `name`; `.name` is the domain and all below it
            lines.append(f"acl sf_d{i} dstdomain {'.' if e.wildcard else ''}{e.name}")
        lines.append(f"http_access allow sf_d{i} sf_p{i}")
    lines.append("http_access deny all")
    return "\n".join(lines) + "\n"


def parse_hosts(lines: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`NAME=ADDRESS` lines (the proxy's own hosts file) as a dict, or PolicyError."""
    out: dict[str, str] = {}
    for line in lines:
        name, sep, addr = line.partition("=")
        name = name.strip().lower()
        if (
            not sep
            or _address(addr.strip()) is None
            or not _NAME.match(name)
            or name.startswith("*")
        ):
            raise PolicyError(f"egress host entry {line[:80]!r}: expected NAME=IP_ADDRESS")
        out[name] = addr.strip()
    return out
