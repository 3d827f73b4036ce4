import pytest

from pdpool.engine.connector.allowlist import (
    AllowlistError,
    PeerNotAllowedError,
    is_allowed,
    parse_allowlist,
    resolve_allowed,
)


def dns(table):
    """A resolver answering from `table` (DNS is the third party we cannot run here)."""

    def resolve(name):
        if name not in table:
            raise OSError(f"unknown host {name}")
        return table[name]

    return resolve


def test_empty_allowlist_means_loopback_only():
    allow = parse_allowlist("")
    assert is_allowed("127.0.0.1", allow)
    assert is_allowed("127.5.6.7", allow)
    assert is_allowed("::1", allow)
    assert not is_allowed("10.0.0.1", allow)
    assert not is_allowed("192.168.1.1", allow)


def test_addresses_and_networks():
    allow = parse_allowlist(" 10.0.0.0/8 , 192.168.1.7,fd00::/8,,", include_loopback=False)
    assert is_allowed("10.255.0.3", allow)
    assert is_allowed("192.168.1.7", allow)
    assert not is_allowed("192.168.1.8", allow)
    assert is_allowed("fd00::12", allow)
    assert is_allowed("[fd00::12]", allow)
    assert is_allowed("::ffff:10.1.2.3", allow)  # IPv4-mapped IPv6 is the IPv4 address
    assert not is_allowed("127.0.0.1", allow)
    assert not is_allowed("11.0.0.1", allow)


def test_unspecified_address_is_never_allowed():
    allow = parse_allowlist("0.0.0.0/0,::/0")
    assert is_allowed("8.8.8.8", allow)
    assert not is_allowed("0.0.0.0", allow)
    assert not is_allowed("::", allow)
    with pytest.raises(PeerNotAllowedError, match="unspecified"):
        resolve_allowed("evil.example", allow, dns({"evil.example": ["0.0.0.0"]}))


def test_named_host_is_allowed_by_name_case_insensitively():
    allow = parse_allowlist("Decode-0.Pool.svc.", include_loopback=False)
    resolver = dns({"decode-0.pool.svc": ["10.1.2.3"]})
    assert resolve_allowed("DECODE-0.pool.svc", allow, resolver) == "10.1.2.3"
    assert not is_allowed("decode-1.pool.svc", allow, dns({"decode-1.pool.svc": ["10.1.2.4"]}))


def test_name_is_allowed_only_if_every_address_is_inside():
    allow = parse_allowlist("10.0.0.0/8", include_loopback=False)
    assert resolve_allowed("p.svc", allow, dns({"p.svc": ["10.0.0.5", "10.0.0.6"]})) == "10.0.0.5"
    with pytest.raises(PeerNotAllowedError, match=r"resolves to 169.254.169.254, outside"):
        resolve_allowed("mixed.svc", allow, dns({"mixed.svc": ["10.0.0.5", "169.254.169.254"]}))


def test_unresolvable_or_empty_host_is_refused():
    allow = parse_allowlist("10.0.0.0/8")
    with pytest.raises(PeerNotAllowedError, match="cannot be resolved"):
        resolve_allowed("nowhere.invalid", allow, dns({}))
    with pytest.raises(PeerNotAllowedError, match="empty"):
        resolve_allowed("  ", allow)
    with pytest.raises(PeerNotAllowedError, match="no address"):
        resolve_allowed("void.svc", allow, dns({"void.svc": []}))


def test_localhost_resolves_for_real():
    assert is_allowed("localhost", parse_allowlist(""))


def test_refusal_names_the_allowlist():
    with pytest.raises(PeerNotAllowedError, match=r"10\.9\.9\.9.*10\.0\.0\.0/16"):
        resolve_allowed("10.9.9.9", parse_allowlist("10.0.0.0/16", include_loopback=False))


@pytest.mark.parametrize(
    "bad", ["10.0.0.1/8", "10.0.0.0/33", "300.1.1.1", "bad_host!", "-lead.example", "a..b", "1.2.3"]
)
def test_bad_entries_raise_naming_the_entry(bad):
    with pytest.raises(AllowlistError, match=repr(bad).replace(".", r"\.")):
        parse_allowlist(f"10.0.0.0/8,{bad}")


def test_accepts_a_list_and_dedupes():
    allow = parse_allowlist(["127.0.0.1", "10.0.0.0/8", "10.0.0.0/8"])
    assert allow.describe().count("10.0.0.0/8") == 1
    assert allow.describe().startswith("127.0.0.0/8,::1/128")


def test_an_address_is_allowed_when_a_listed_name_resolves_to_it():
    """A Kubernetes pool lists its headless Services: their names resolve to the pool's own
    ready pods, so those pods' IPs (what kv_transfer_params carry) are peers, others not."""
    allow = parse_allowlist("demo-prefill.llm.svc,demo-decode.llm.svc")
    resolver = dns(
        {"demo-prefill.llm.svc": ["10.1.0.5", "10.1.0.6"], "demo-decode.llm.svc": ["10.1.0.9"]}
    )
    assert resolve_allowed("10.1.0.6", allow, resolver) == "10.1.0.6"
    assert resolve_allowed("10.1.0.9", allow, resolver) == "10.1.0.9"
    with pytest.raises(PeerNotAllowedError, match="not in the KV peer allowlist"):
        resolve_allowed("10.1.0.7", allow, resolver)  # another pool's pod, same network
    # A listed name that does not resolve (no ready pods) allows nothing.
    assert not is_allowed("10.1.0.5", allow, dns({"demo-decode.llm.svc": ["10.1.0.9"]}))
    assert not is_allowed("0.0.0.0", allow, dns({"demo-prefill.llm.svc": ["0.0.0.0"]}))
