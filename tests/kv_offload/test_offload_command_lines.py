"""`pdpool up --kv-offload` and `spec.kvOffload` give engines the same tier flags, and those
flags make a valid engine config through the real `pdpool serve` parser: a directory per
engine for disk, one directory for all engines for shared."""

from __future__ import annotations

import pytest

from pdpool.cli import build_parser
from pdpool.engine.serve_cli import config_from_args
from pdpool.errors import CliError
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec
from pdpool.up.cli import spec_from_args
from pdpool.up.topology import Topology


def _engine_configs(topology: Topology):
    out = []
    for child in topology.children:
        if child.role in ("prefill", "decode"):
            argv = child.argv[child.argv.index("serve") :]
            config = config_from_args(build_parser().parse_args(argv))
            config._check_offload()  # the tier's flags are consistent
            out.append(config)
    return out


def _topology(tmp_path, *flags: str) -> Topology:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    args = build_parser().parse_args(
        ["up", "--model", str(model), "--log-dir", str(tmp_path / "logs"), "--decode", "2", *flags]
    )
    return Topology(spec_from_args(args))  # planned, never started


def test_disk_is_a_directory_per_engine_shared_one_for_all(tmp_path):
    disk = _engine_configs(_topology(tmp_path, "--kv-offload", "disk", "--kv-offload-size", "3"))
    assert len(disk) == 3 and {c.kv_offloading_backend for c in disk} == {"disk"}
    assert {c.kv_offloading_size for c in disk} == {3.0}
    assert len({c.kv_offloading_path for c in disk}) == 3
    shared = _engine_configs(
        _topology(tmp_path, "--kv-offload", "shared", "--kv-offload-dir", str(tmp_path / "pvc"))
    )
    assert {c.kv_offloading_path for c in shared} == {str(tmp_path / "pvc")}
    assert {c.kv_offloading_backend for c in shared} == {"shared"}
    native = _engine_configs(_topology(tmp_path, "--kv-offload", "native"))
    assert {(c.kv_offloading_backend, c.kv_offloading_path) for c in native} == {("native", None)}
    off = _engine_configs(_topology(tmp_path))
    assert {c.kv_offloading_size for c in off} == {None}


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (("--kv-offload", "disk", "--kv-offload-size", "0"), r"--kv-offload-size must be in \(0, "),
        (("--kv-offload", "disk", "--engine", "vllm"), "for stock vLLM pass its own flags"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, flags, fragment):
    with pytest.raises(CliError, match=fragment):
        _topology(tmp_path, *flags)


def test_operator_and_pdpool_up_pass_the_same_flags(tmp_path):
    ref = PoolRef(name="demo", namespace="llm", uid="u")
    pool = parse_pool_spec(
        "demo",
        {
            "model": {"path": "/models/m"},
            "engine": {"image": "e:1"},
            "kvOffload": {"backend": "shared", "sizeGiB": 3, "pvc": "kv"},
        },
    )
    pods = [m for m in build_children(ref, pool) if m["kind"] == "Deployment"]
    engine_argvs = [
        c["command"]
        for m in pods
        for c in m["spec"]["template"]["spec"]["containers"]
        if c["name"] == "engine"
    ]
    local = _topology(tmp_path, "--kv-offload", "shared", "--kv-offload-size", "3")
    local_argvs = [c.argv for c in local.children if c.role in ("prefill", "decode")]
    for ours in engine_argvs + local_argvs:
        tier = sorted(a.split("=")[0] for a in ours if a.startswith("--kv-offloading-"))
        assert tier == [
            "--kv-offloading-backend",
            "--kv-offloading-path",
            "--kv-offloading-size",
        ]
        assert "--kv-offloading-size=3" in ours and "--kv-offloading-backend=shared" in ours
