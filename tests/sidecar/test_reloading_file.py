"""Hot reload never takes half a file (net/reloading.py, under the tenants file and the API
keys file alike): a file rewritten in place is read by a real reader between the writer's
writes, and the second write keeps the first one's modification time (two writes in one
tick of the file system's clock)."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import pytest

from pdpool.sidecar.net.apikeys import ApiKeys
from pdpool.sidecar.flow.tenants import TenantsFile


def tenants_text(version: str) -> str:
    lines = ["tenants:"]
    for n in range(40):
        lines.append(f"  - name: t{n}-{version}")
        lines.append(f"    keys: ['key-{version}-{n:02d}-0123456789']")
    return "\n".join(lines) + "\n"


def keys_text(version: str) -> str:
    return "".join(f"key-{version}-{n:02d}-0123456789\n" for n in range(40))


def tenants_seen(path: str) -> tuple[object, Callable[[], list[str]]]:
    source = TenantsFile(path, recheck_s=0)
    return source, lambda: sorted(source.current().tenants)


def keys_seen(path: str) -> tuple[object, Callable[[], list[str]]]:
    source = ApiKeys(path, recheck_s=0)
    # the keys the gateway lets in, of both versions
    names = [f"key-{v}-{n:02d}-0123456789" for v in ("v1", "v2") for n in range(40)]
    return source, lambda: [k for k in names if source.allows(k)]


def _cut(text: str) -> str:
    """The first half of the file, ending at a line boundary: a file that parses."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[: len(lines) // 2])


@pytest.mark.parametrize(
    ("reader", "text"),
    [(tenants_seen, tenants_text), (keys_seen, keys_text)],
    ids=["tenants", "keys"],
)
def test_a_file_rewritten_in_place_is_never_half_read(tmp_path, reader, text):
    path = tmp_path / "file"
    path.write_text(text("v1"))
    _, seen = reader(str(path))
    before = seen()
    assert len(before) == 40
    new = text("v2")
    with open(path, "w", encoding="utf-8") as writer:
        writer.write(_cut(new))
        writer.flush()  # the reader finds the first half: it parses, and is not the file
        tick = os.stat(path).st_mtime_ns
        assert seen() == before
        writer.write(new[len(_cut(new)) :])
    os.utime(path, ns=(tick, tick))  # the second write within the first one's tick
    deadline = time.monotonic() + 5
    while seen() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    after = seen()
    assert len(after) == 40 and after != before  # the whole new file, once it settled


def test_a_broken_file_keeps_the_last_good_one_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text(keys_text("v1"))
    keys = ApiKeys(str(path), recheck_s=0, settle_s=0)
    path.write_text("short\n")
    with caplog.at_level(logging.WARNING, logger="pdpool.reload"):
        for _ in range(5):
            assert keys.allows("key-v1-00-0123456789")
    warned = [r for r in caplog.records if "keeping the last good one" in r.getMessage()]
    assert len(warned) == 1 and "shorter than 16" in warned[0].getMessage()


def test_an_atomic_replacement_is_taken(tmp_path):
    """What the docs ask of writers: a temporary file renamed over the old one."""
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_text("v1"))
    source = TenantsFile(str(path), recheck_s=0, settle_s=0)
    temp = tmp_path / ".tenants.yaml.tmp"
    temp.write_text(tenants_text("v2"))
    os.replace(temp, path)
    source.current()
    assert "t0-v2" in source.current().tenants and len(source.current().tenants) == 40
