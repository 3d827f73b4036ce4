"""`pdpool up --sidecar-arg` reaches every sidecar: the LoRA flags that let a sidecar load a
decode engine's adapter on a prefill engine, as the real `pdpool sidecar` parser reads them
(a bad folder is a one-line CLI error)."""

from __future__ import annotations

import pytest

from pdpool.cli import build_parser
from pdpool.errors import CliError
from pdpool.sidecar.proxy.cli import settings_from_args
from pdpool.up.cli import spec_from_args
from pdpool.up.topology import Topology


def sidecar_settings(tmp_path, *flags: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    args = build_parser().parse_args(
        ["up", "--model", str(model), "--log-dir", str(tmp_path / "logs"), "--decode", "2", *flags]
    )
    topology = Topology(spec_from_args(args))  # planned, never started
    out = []
    for child in topology.children:
        if child.role == "sidecar":
            argv = child.argv[child.argv.index("sidecar") :]
            out.append(settings_from_args(build_parser().parse_args(argv)))
    return out


def test_every_sidecar_gets_the_lora_flags(tmp_path):
    got = sidecar_settings(
        tmp_path,
        "--sidecar-arg=--lora-allowed-dir=/adapters",
        "--sidecar-arg=--adapter-models-ttl-s=2",
    )
    assert len(got) == 2
    assert {(tuple(s.lora_allowed_dirs), s.adapter_models_ttl_s) for s in got} == {
        (("/adapters",), 2.0)
    }
    assert {tuple(s.lora_allowed_dirs) for s in sidecar_settings(tmp_path)} == {()}


@pytest.mark.parametrize(
    "flag, fragment",
    [
        ("--sidecar-arg=--lora-allowed-dir=adapters", "lora_allowed_dirs must be absolute"),
        ("--sidecar-arg=--lora-allowed-dir=/", "lora_allowed_dirs must be absolute"),
        ("--sidecar-arg=--adapter-models-ttl-s=-1", "adapter_models_ttl_s must be >= 0"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, flag, fragment):
    with pytest.raises(CliError, match=fragment):
        sidecar_settings(tmp_path, flag)
