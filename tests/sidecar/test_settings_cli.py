"""Sidecar settings from a config file (an operator's ConfigMap) and flags."""

import json
import subprocess

import pytest

from pdpool.sidecar.proxy.settings import build_settings, load_config_file
from pdpool.up.topology import pdpool_command


def test_yaml_file_then_flags_override(tmp_path):
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        "decode-url: http://10.0.0.1:8001/\nmode: prefill-first\n"
        "cache_hit_threshold: 0.7\nprefill_urls: 10.0.0.2:8000\n"
    )
    s = build_settings(load_config_file(str(cfg)), {"mode": None, "cache_hit_threshold": 0.2})
    assert s.decode_url == "http://10.0.0.1:8001" and s.mode == "prefill-first"
    assert s.cache_hit_threshold == 0.2 and s.prefill_urls == ["10.0.0.2:8000"]
    js = tmp_path / "sidecar.json"
    js.write_text(json.dumps({"prefill_service": "prefill.ns.svc:8000"}))
    assert build_settings(load_config_file(str(js)), {}).prefill_service == "prefill.ns.svc:8000"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("unknown_key: 1\n", "unknown setting"),
        ("- a\n- b\n", "must hold a mapping"),
        ("mode: sideways\n", "mode must be one of"),
        ("cache_hit_threshold: 3\n", "[0, 1]"),
        ("decode_url: ftp://x\n", "http://"),
    ],
)
def test_bad_settings_are_one_line_cli_errors(tmp_path, text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    done = subprocess.run(
        pdpool_command("sidecar", "--config", str(cfg), "--port", "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_gateway_without_backends_is_a_cli_error():
    done = subprocess.run(
        pdpool_command("gateway", "--port", "0"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--decode-url" in done.stderr


def test_the_operators_sidecar_command_line_parses():
    """The operator renders the sidecar's argv; every flag it uses must exist here."""
    commands = pytest.importorskip("pdpool.operator.commands")
    from pdpool.cli import build_parser
    from pdpool.sidecar.proxy.cli import settings_from_args

    values = {
        "PDPOOL_ROUTER_MODE": "decode-first",
        "PDPOOL_CACHE_HIT_THRESHOLD": "0.6",
        "PDPOOL_KV_PULL_THRESHOLD": "64",
        "PDPOOL_PREFILL_TIMEOUT": "15",
        "PDPOOL_PREFILL_SERVICE": "prefill.ns.svc.cluster.local:8000",
        "PDPOOL_ENGINE_REJECTS": "no",
    }
    from pdpool.operator.spec import parse_pool_spec

    pool = parse_pool_spec("demo", {"model": {"path": "/m"}, "engine": {"image": "e:1"}})
    argv = commands.sidecar_args(pool)[1:]
    for var, value in values.items():
        argv = [a.replace(f"$({var})", value) for a in argv]
    args = build_parser().parse_args(argv)
    s = settings_from_args(args)
    assert (s.mode, s.cache_hit_threshold, s.kv_pull_threshold, s.prefill_timeout) == (
        "decode-first",
        0.6,
        64,
        15.0,
    )
    assert s.prefill_service == "prefill.ns.svc.cluster.local:8000"
    assert s.engine_rejects == "no"
    gw = build_parser().parse_args(commands.gateway_args(pool, "decode.ns.svc:8000")[1:])
    assert gw.decode_service == "decode.ns.svc:8000"
