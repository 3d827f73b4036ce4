"""`pdpool up` flags read through its settings (pdpool/up/spec.py): values no topology can
have are refused with a non-zero exit and one line naming the flag, before a model is made
or a process starts; the values a flag gives reach the topology's spec."""

from __future__ import annotations

import pytest

from pdpool.cli import build_parser, main
from pdpool.up.cli import spec_from_args


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode", "0"], "--decode must be in [1, 256], got 0"),
        (["--prefill", "-1"], "--prefill must be in [0, 256], got -1"),
        (["--decode", "1000000"], "--decode must be in [1, 256]"),
        (["--port", "-1"], "--port must be in [0, 65535]"),
        (["--port", "99999999999999999999"], "--port must be in [0, 65535]"),
        (["--cache-hit-threshold", "1.5"], "--cache-hit-threshold must be in [0, 1]"),
        (["--cache-hit-threshold", "nan"], "--cache-hit-threshold must be in [0, 1], got nan"),
        (["--prefill-timeout", "0"], "--prefill-timeout must be in (0, 604800]"),
        (["--prefill-timeout", "inf"], "--prefill-timeout must be in (0, 604800], got inf"),
        (["--decode-retry-s", "-1"], "--decode-retry-s must be in [0, 604800]"),
        (["--decode-retry-s", "1e300"], "--decode-retry-s must be in [0, 604800]"),
        (["--kv-offload-size", "0"], "--kv-offload-size must be in (0, 1048576]"),
        (["--kv-offload-size", "1e30"], "--kv-offload-size must be in (0, 1048576]"),
        (["--kv-offload", "disk", "--engine", "vllm"], "--kv-offload runs pdpool's tiers"),
        (["--prefill-min-prompt-tokens", "-3"], "--prefill-min-prompt-tokens must be in [0,"),
        (["--ready-timeout", "-5"], "--ready-timeout must be in (0, 604800]"),
        (["--autoscale", "--autoscale-interval-s", "nan"], "--autoscale-interval-s must be in"),
        (["--autoscale", "--ttft-target-ms", "-1"], "--ttft-target-ms must be in (0,"),
        (["--autoscale", "--decode-max", "100000"], "--decode-max must be in [0, 256]"),
        (["--autoscale", "--scale-down-window-s", "inf"], "--scale-down-window-s must be in"),
        (["--autoscale", "--prefill", "2", "--prefill-max", "1"], "need 0 <= min <= max"),
    ],
)
def test_a_value_no_topology_can_have_is_one_line_of_why(flags, message, tmp_path, capsys):
    assert main(["up", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdpool up: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--mode", "sideways"],
        ["--prefill", "two"],
        ["--port", "80.5"],
        ["--kv-offload-size", "big"],
        ["--engine", "tgi"],
        ["--pull-from-decode=no"],
        ["--no-such-flag"],
    ],
)
def test_a_wrong_type_or_choice_is_refused_by_the_parser(flags, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["up", *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    why = err.strip().splitlines()[-1]  # argparse: the usage, then one line of why
    assert why.startswith(("pdpool up: error: ", "pdpool: error: ")), err
    assert flags[-1].split("=")[0] in why or flags[-1] in why, why


def test_the_flags_reach_the_spec(tmp_path):
    args = build_parser().parse_args(
        [
            "up",
            "--model",
            str(tmp_path),
            "--prefill=0",
            "--decode=3",
            "--port=0",
            "--no-pull-from-decode",
            "--decode-retry-s=7.5",
            "--engine-arg=--num-kv-blocks=64",
            "--engine-arg=--max-model-len=512",
            "--kv-offload=disk",
            "--kv-offload-size=2",
            "--kv-offload-dir=rel",
            "--tenants-file=t.yaml",
            "--sidecar-arg=--x=1",
            "--autoscale",
        ]
    )
    spec = spec_from_args(args)
    assert (spec.model, spec.prefill, spec.decode, spec.port) == (str(tmp_path), 0, 3, 0)
    assert spec.pull_from_decode is False and spec.decode_retry_s == 7.5
    assert spec.engine_args == ["--num-kv-blocks=64", "--max-model-len=512"]
    assert (spec.kv_offload, spec.kv_offload_size_gib) == ("disk", 2.0)
    # paths are made absolute where read: the children run in other folders
    assert spec.kv_offload_dir is not None and spec.kv_offload_dir.endswith("/rel")
    assert spec.tenants_file is not None and spec.tenants_file.startswith("/")
    assert spec.sidecar_args == ["--x=1"] and spec.discovery_files is True
    # nothing given: the command line's defaults, the ones its --help describes
    plain = spec_from_args(build_parser().parse_args(["up", "--model", str(tmp_path)]))
    assert (plain.port, plain.decode_retry_s, plain.engine_args) == (8080, 30.0, [])
