"""Prefill endpoints from the DNS of a (headless) Service, refreshed."""

import pytest

from pdpool.sidecar.net.discovery import EndpointSet, parse_service


async def test_service_resolves_and_keeps_last_good_set_on_dns_errors():
    eps = EndpointSet(static=["http://10.0.0.9:7000"], service="localhost:8123", refresh_s=0.05)
    await eps.start()
    try:
        assert "127.0.0.1:8123" in eps.current
        assert eps.current[0] == "10.0.0.9:7000"  # static endpoints come first
        eps._service = ("no-such-host.invalid", 8123)
        await eps.resolve_once()
        assert "127.0.0.1:8123" in eps.current
    finally:
        await eps.stop()


@pytest.mark.parametrize("value", ["nohost", "host:", ":80", "host:http"])
def test_bad_service_values(value):
    with pytest.raises(ValueError):
        parse_service(value)
