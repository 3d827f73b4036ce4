"""Which hosts this engine may pull KV from (`--kv-peer-allowlist`).

A request's `kv_transfer_params` names the host to read from, so without a check any client
could make the engine connect anywhere (SSRF). Policy:

- an entry is an IP address, a CIDR network, or a host name; entries are comma separated;
- loopback (127.0.0.0/8, ::1) is always allowed, so an empty allowlist means "local peers
  only" (the `pdpool up` topology) and a cluster adds its pod CIDR or service names;
- a host name in a request is allowed if it is listed by name, or if EVERY address it
  resolves to lies in an allowed network (one stray DNS record is enough to refuse);
- an address in a request is allowed if it lies in an allowed network, or if a listed host
  name resolves to it now: a Kubernetes pool lists its headless Services
  (`<pool>-prefill.<ns>.svc`), whose names resolve to exactly the pool's ready pods, so
  peers are the pool's own pods and nothing else on the pod network;
- the unspecified address (0.0.0.0, ::) is never allowed: it is not a place to connect to.

Pure except for name resolution, which is injectable for tests.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Callable, Iterable

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], list[str]]

LOOPBACK_NETWORKS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


class AllowlistError(ValueError):
    """An allowlist entry that is neither an address, a network nor a host name."""


class PeerNotAllowedError(PermissionError):
    """A peer host outside the allowlist (or one that cannot be resolved)."""


@dataclass(frozen=True)
class Allowlist:
    networks: tuple[IPNetwork, ...]
    hostnames: frozenset[str]

    def describe(self) -> str:
        return ",".join([str(n) for n in self.networks] + sorted(self.hostnames))


def _normalize_hostname(name: str) -> str:
    return name.strip().lower().rstrip(".")


def _is_hostname(name: str) -> bool:
    labels = name.split(".")
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in labels)


def _parse_entry(entry: str) -> IPNetwork | str:
    try:
        if "/" in entry:
            return ipaddress.ip_network(entry, strict=True)
        return ipaddress.ip_network(ipaddress.ip_address(entry))
    except ValueError as exc:
        if "/" in entry or re.fullmatch(r"[0-9.:]+", entry):
            raise AllowlistError(f"invalid allowlist entry {entry!r}: {exc}") from None
    name = _normalize_hostname(entry)
    if not _is_hostname(name):
        raise AllowlistError(f"invalid allowlist entry {entry!r}: not an IP, CIDR or host name")
    return name


def parse_allowlist(spec: str | Iterable[str] | None, include_loopback: bool = True) -> Allowlist:
    """`"10.0.0.0/8,127.0.0.1,decode-0.pool.svc"` -> Allowlist. Raises AllowlistError."""
    if spec is None:
        entries: list[str] = []
    elif isinstance(spec, str):
        entries = spec.split(",")
    else:
        entries = list(spec)
    networks: list[IPNetwork] = list(LOOPBACK_NETWORKS) if include_loopback else []
    hostnames: set[str] = set()
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        parsed = _parse_entry(entry)
        if isinstance(parsed, str):
            hostnames.add(parsed)
        elif parsed not in networks:
            networks.append(parsed)
    return Allowlist(tuple(networks), frozenset(hostnames))


def system_resolver(host: str) -> list[str]:
    """All addresses `host` resolves to (TCP), in resolver order."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _as_address(text: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _address_allowed(address: IPAddress, allowlist: Allowlist) -> bool:
    if address.is_unspecified:
        return False
    return any(
        address in network for network in allowlist.networks if network.version == address.version
    )


def _listed_name_resolves_to(address: IPAddress, allowlist: Allowlist, resolver: Resolver) -> bool:
    """Some allowlisted host name resolves to `address` (now; names that do not resolve
    count as nothing)."""
    if address.is_unspecified:
        return False
    for name in sorted(allowlist.hostnames):
        try:
            resolved = {_as_address(r) for r in resolver(name)}
        except OSError:
            continue
        if address in resolved:
            return True
    return False


def resolve_allowed(host: str, allowlist: Allowlist, resolver: Resolver = system_resolver) -> str:
    """The address to connect to for `host`, or PeerNotAllowedError saying why not.

    Returning the vetted address (rather than a yes/no) lets the caller connect to exactly
    what was checked, so a second DNS answer cannot redirect the connection.
    """
    text = (host or "").strip().strip("[]")
    if not text:
        raise PeerNotAllowedError("empty peer host")
    literal = _as_address(text)
    if literal is not None:
        if _address_allowed(literal, allowlist) or _listed_name_resolves_to(
            literal, allowlist, resolver
        ):
            return str(literal)
        raise PeerNotAllowedError(
            f"peer {host!r} is not in the KV peer allowlist ({allowlist.describe()})"
        )
    name = _normalize_hostname(text)
    try:
        resolved = [a for a in (_as_address(r) for r in resolver(name)) if a is not None]
    except OSError as exc:
        raise PeerNotAllowedError(f"peer {host!r} cannot be resolved: {exc}") from None
    if not resolved:
        raise PeerNotAllowedError(f"peer {host!r} resolves to no address")
    if any(a.is_unspecified for a in resolved):
        raise PeerNotAllowedError(f"peer {host!r} resolves to an unspecified address")
    if name in allowlist.hostnames or all(_address_allowed(a, allowlist) for a in resolved):
        return str(resolved[0])
    outside = [str(a) for a in resolved if not _address_allowed(a, allowlist)]
    raise PeerNotAllowedError(
        f"peer {host!r} resolves to {', '.join(outside)}, outside the "
        f"KV peer allowlist ({allowlist.describe()})"
    )


def is_allowed(host: str, allowlist: Allowlist, resolver: Resolver = system_resolver) -> bool:
    try:
        resolve_allowed(host, allowlist, resolver)
    except PeerNotAllowedError:
        return False
    return True
