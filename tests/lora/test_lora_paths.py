"""The allowed-folder rule shared by the engine's /v1/load_lora_adapter and the sidecar
(which must not trust a decode engine's adapter path), and the sidecar's reading of a
/v1/models answer: hostile paths and malformed answers are refused, never followed."""

from __future__ import annotations

import os

import pytest

from pdpool.lora_paths import is_under_allowed_dir, resolved_dirs
from pdpool.sidecar.proxy.adapter_legs import AdapterCard, adapter_cards
from pdpool.sidecar.proxy.settings import build_settings


def test_paths_under_the_allowed_folders_only(tmp_path):
    allowed = tmp_path / "adapters"
    (allowed / "alpha").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", allowed / "escape")
    dirs = resolved_dirs([str(allowed)])
    assert is_under_allowed_dir(str(allowed / "alpha"), dirs)
    assert is_under_allowed_dir(str(allowed), dirs)
    for hostile in (
        str(allowed / ".." / "secret"),  # climbs out
        str(allowed / "escape"),  # a symlink out
        str(allowed) + "-evil/alpha",  # a sibling sharing the prefix
        "alpha",  # relative: resolved against whatever the cwd is
        "",
        str(allowed / "alpha") + "\x00",
        "/",
    ):
        assert not is_under_allowed_dir(hostile, dirs), hostile
    assert not is_under_allowed_dir(str(allowed / "alpha"), ())  # none allowed: fail closed
    assert not is_under_allowed_dir(None, dirs)  # type: ignore[arg-type]


def test_the_engine_registry_uses_the_same_rule(tmp_path):
    from pdpool.engine.lora.adapter_dir import AdapterError
    from pdpool.engine.lora.registry import LoRARegistry

    allowed = tmp_path / "adapters"
    allowed.mkdir()
    registry = LoRARegistry("base", 16, (str(allowed),))
    with pytest.raises(AdapterError, match="outside --lora-allowed-dir"):
        registry.check_new("x", str(allowed / ".." / "x"), dynamic=True)


def test_adapter_cards_of_a_models_answer():
    payload = {
        "data": [
            {"id": "base", "root": "/models/base", "parent": None},
            {"id": "alpha", "root": "/adapters/alpha", "parent": "base"},
            {"id": "odd", "root": 7, "parent": "base"},  # no usable path
            {"id": 3},
            "junk",
        ]
    }
    ids, adapters = adapter_cards(payload)
    assert ids == {"base", "alpha", "odd"}
    assert adapters == {"alpha": AdapterCard("alpha", "/adapters/alpha")}
    for junk in (None, [], {"data": "x"}, {"data": None}, "text"):
        assert adapter_cards(junk) == (set(), {})


@pytest.mark.parametrize("dirs", [["rel"], ["/"], [7], {"a": 1}])
def test_the_sidecar_refuses_bad_allowed_folders(dirs):
    with pytest.raises(ValueError, match="lora_allowed_dirs"):
        build_settings({}, {"lora_allowed_dirs": dirs})
