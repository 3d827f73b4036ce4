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


async def test_file_endpoints_follow_the_file_and_keep_the_last_set_when_it_vanishes(tmp_path):
    path = tmp_path / "decode.txt"
    path.write_text("127.0.0.1:9001\n# a comment\nhttp://127.0.0.1:9002/\n")
    eps = EndpointSet(service=f"file:{path}", refresh_s=5.0)
    await eps.start()
    try:
        assert eps.current == ["127.0.0.1:9001", "127.0.0.1:9002"]
        path.write_text("127.0.0.1:9002\n")
        await eps.resolve_once()
        assert eps.current == ["127.0.0.1:9002"]
        path.unlink()
        await eps.resolve_once()
        assert eps.current == ["127.0.0.1:9002"]  # a missing file does not empty the pool
    finally:
        await eps.stop()
    with pytest.raises(ValueError, match="file: needs a path"):
        EndpointSet(service="file:")
