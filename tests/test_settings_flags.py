"""Flags generated from the settings dataclasses (pdpool/settings_flags.py): every flag's
default is its field's, every field with a flag is read back from the command line, and the
values a flag gives as text (sizes, lists) reach the settings in their types."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
from dataclasses import MISSING

import pytest

from pdpool.cli import COMMANDS as COMMAND_MODULES
from pdpool.cli import CliError, build_parser
from pdpool.engine.config import EngineConfig
from pdpool.engine.structured.limits import StructuredLimits
from pdpool.settings_flags import (
    Flag,
    add_flags,
    field_default,
    flagged_fields,
    option_name,
    setting,
    values_from_args,
)
from pdpool.sidecar.epp.settings import EppSettings
from pdpool.sidecar.gateway.settings import GatewaySettings
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.up.spec import SIDE_BY_SIDE, AutoscaleSettings, RunSettings, TopologySpec

# command, its settings classes, the arguments it cannot do without, overlay (flags over a file)
COMMANDS = [
    ("serve", (EngineConfig,), ["/models/m"], False),
    ("gateway", (GatewaySettings,), [], False),
    ("epp", (EppSettings,), [], False),
    ("sidecar", (SidecarSettings,), [], True),
    ("up", (RunSettings, TopologySpec, AutoscaleSettings), [], False),
]
IDS = [c[0] for c in COMMANDS]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags_of(cls: type, prefix: str = ""):
    """(field, its Flag, its option string) of every flagged field, nested ones included."""
    for f, flag in flagged_fields(cls):
        if flag.nested is not None:
            yield from flags_of(flag.nested, flag.prefix)
        elif not flag.positional:
            yield f, flag, option_name(f, flag, prefix)


@pytest.mark.parametrize("command,classes,required,overlay", COMMANDS, ids=IDS)
def test_each_flags_default_is_its_fields_default(command, classes, required, overlay):
    actions = {s: a for a in subparser(command)._actions for s in a.option_strings}
    seen = 0
    for cls in classes:
        for f, flag, option in flags_of(cls):
            action = actions[option]  # every flagged field has its flag
            default = field_default(f)
            if overlay:
                assert action.default is None, option  # not given: the file's value stands
            elif flag.repeat is not None:
                assert action.default == list(default), option  # appended to: a list
            else:
                assert action.default == default and type(action.default) is type(default), option
            seen += 1
    assert seen >= 20
    # ...and read back, a command line without flags gives the dataclasses' defaults
    args = subparser(command).parse_args(required)
    for cls in classes:
        built = values_from_args(cls, args, overlay=overlay)
        expected = {f.name: field_default(f) for f, _ in flagged_fields(cls)}
        if overlay:
            assert built == {}  # nothing given, nothing overrides
        else:
            assert built == {**expected, **({"model": "/models/m"} if cls is EngineConfig else {})}


def hand_written_defaults(command: str) -> dict[str, int]:
    """option -> how many defaults the command's module writes in its parser itself:
    `add_argument(OPTION, default=X)` or `add_switch(p, OPTION, X, ...)`, X not None."""
    module = importlib.import_module(COMMAND_MODULES[command][0])
    counts: dict[str, int] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "add_argument":
            option, default = (
                node.args[0],
                next((k.value for k in node.keywords if k.arg == "default"), None),
            )
        elif name == "add_switch" and len(node.args) >= 3:
            option, default = node.args[1], node.args[2]
        else:
            continue
        if default is None or (isinstance(default, ast.Constant) and default.value is None):
            continue
        assert isinstance(option, ast.Constant), ast.dump(option)
        counts[option.value] = counts.get(option.value, 0) + 1
    return counts


@pytest.mark.parametrize("command,classes,required,overlay", COMMANDS, ids=IDS)
def test_each_default_is_held_in_one_place(command, classes, required, overlay):
    """The places holding a flag's default: its field, and any default the command's parser
    writes itself (where, the listen address, is no setting). One each, never both."""
    hand = hand_written_defaults(command)
    fields = {
        option: field_default(f)
        for cls in classes
        for f, _, option in flags_of(cls)
        if field_default(f) not in (None, MISSING)
    }
    assert not set(hand) & set(fields), "a default in both the parser and its field"
    assert all(n == 1 for n in hand.values()), hand
    places = sum(hand.values()) + len(fields)
    options = {s for a in subparser(command)._actions for s in a.option_strings}
    assert places == len(set(hand) | set(fields)) and set(hand) <= options
    if command == "up":  # every flag of `pdpool up` is a setting's: none written by hand
        assert hand == {} and places >= 20


def test_up_hands_the_sidecars_their_own_defaults_and_help():
    """A topology setting passed on to every sidecar reads the sidecar's field: one default,
    one help text; those `pdpool up` chooses differently say so in spec.py."""
    sidecar = {f.name: (f, flag) for f, flag in flagged_fields(SidecarSettings)}
    up = {f.name: (f, flag) for f, flag in flagged_fields(TopologySpec)}
    for name in ("mode", "cache_hit_threshold", "pull_from_decode", "prefill_timeout"):
        (f, flag), (sf, sflag) = up[name], sidecar[name]
        assert field_default(f) == field_default(sf), name
        assert flag.help == f"sidecars: {sflag.help}" and flag.choices == sflag.choices, name
    # chosen here: a user's decode restart is ridden out; the engine decides rejecting
    assert (
        field_default(up["decode_retry_s"][0])
        == 30.0
        != field_default(sidecar["decode_retry_s"][0])
    )
    assert field_default(up["engine_rejects"][0]) is None
    # not given: the sidecar's own, named in the help from its field
    tokens = field_default(sidecar["prefill_min_prompt_tokens"][0])
    assert f"the sidecar's, {tokens})" in up["prefill_min_prompt_tokens"][1].help
    # what programs starting topologies side by side pass: any port, the sidecar's retry
    assert {
        "port": 0,
        "decode_retry_s": field_default(sidecar["decode_retry_s"][0]),
    } == SIDE_BY_SIDE


@pytest.mark.parametrize("command,classes,required,overlay", COMMANDS, ids=IDS)
def test_no_help_spells_out_a_default_that_could_drift(command, classes, required, overlay):
    """A default written again in a help text is a second place to change; the generated
    ones (%(default)s, or the overlay's suffix) read the field."""
    for f, flag, option in (x for cls in classes for x in flags_of(cls)):
        default = field_default(f)
        if flag.help is None or default in (None, [], {}) or isinstance(default, bool):
            continue
        shown = format(default, "g") if isinstance(default, float) else str(default)
        assert not re.search(r"default[: ]+" + re.escape(shown) + r"\b", flag.help), option


def test_the_engine_config_comes_from_the_flags_with_their_types():
    from pdpool.engine.serve_cli import config_from_args

    argv = [
        "serve",
        "/m",
        "--max-body-bytes",
        "64MiB",
        "--structured-cache-bytes",
        "1GiB",
        "--kv-cache-memory",
        "512MiB",
        "--kv-peer-allowlist",
        "10.0.0.1, 10.0.1.0/24,,",
        "--structured-max-depth",
        "7",
        "--no-enable-prefix-caching",
        "--enable-lora",
        "--lora-modules",
        "a=/x",
        "b=/y",
        "--lora-allowed-dir",
        "/p",
        "--lora-allowed-dir",
        "/q",
        "--cpu-threads",
        "3",
        "--kv-offloading-size",
        "1.5",
    ]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.max_body_bytes == 64 << 20 and config.structured_cache_bytes == 1 << 30
    assert config.kv_cache_memory == 512 << 20
    assert config.kv_peer_allowlist == ["10.0.0.1", "10.0.1.0/24"]
    assert config.structured_limits == StructuredLimits(max_depth=7)
    assert config.enable_prefix_caching is False and config.enable_lora is True
    assert config.lora_modules == ["a=/x", "b=/y"] and config.lora_allowed_dirs == ["/p", "/q"]
    # --cpu-threads alone sets both counts (serve_cli.prefill_threads)
    assert config.cpu_threads == 3 and config.cpu_prefill_threads == 3
    assert config.kv_offloading_size == 1.5


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--max-body-bytes", "lots"], "cannot read 'lots' as a size"),
        (["--structured-cache-bytes", "-1"], "cannot read '-1' as a size"),
    ],
)
def test_an_unreadable_size_is_a_one_line_cli_error(argv, needle):
    from pdpool.engine.serve_cli import config_from_args

    with pytest.raises(CliError, match=re.escape(needle)):
        config_from_args(build_parser().parse_args(["serve", "/m", *argv]))


def test_a_wrong_type_or_choice_is_refused_by_the_parser(capsys):
    for argv in (["--block-size", "x"], ["--device", "tpu"], ["--kv-offloading-size", "big"]):
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(["serve", "/m", *argv])
        assert stop.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_routing_flags_mean_the_same_on_the_gateway_and_the_picker():
    argv = ["--decode-url", "a:1", "--kv-events", "http://a:1=tcp://a:5557", "--balance", "2"]
    for command in ("gateway", "epp"):
        args = build_parser().parse_args([command, *argv])
        cls = GatewaySettings if command == "gateway" else EppSettings
        settings = cls(**values_from_args(cls, args))
        assert settings.decode_urls == ["a:1"] and settings.balance == 2.0
        assert settings.kv_events == {"http://a:1": "tcp://a:5557"}
    with pytest.raises(ValueError, match="--kv-events wants TARGET="):
        values_from_args(
            GatewaySettings, build_parser().parse_args(["gateway", "--kv-events", "junk"])
        )


def test_sidecar_flags_override_the_file_and_only_when_given(tmp_path):
    from pdpool.sidecar.proxy.cli import settings_from_args

    cfg = tmp_path / "s.yaml"
    cfg.write_text("prefill_timeout: 9\nkv_block_size: 32\nmax_body_bytes: 2MiB\n")
    args = build_parser().parse_args(
        ["sidecar", "--config", str(cfg), "--kv-block-size", "64", "--no-pull-from-decode"]
    )
    s = settings_from_args(args)
    assert (s.prefill_timeout, s.kv_block_size, s.pull_from_decode) == (9, 64, False)
    assert s.max_body_bytes == 2 << 20
    plain = settings_from_args(build_parser().parse_args(["sidecar"]))
    assert plain == SidecarSettings().validate()
    with pytest.raises(CliError, match="cannot read"):
        settings_from_args(build_parser().parse_args(["sidecar", "--max-body-bytes", "x"]))


def test_a_generated_flag_follows_its_field():
    @dataclasses.dataclass
    class Knobs:
        width: int = setting(3, help="how wide")
        ratio: float = setting(0.5)
        name: str = setting("a", choices=("a", "b"))
        on: bool = setting(True, switch=True, help="on or off")
        items: list[str] = setting(default_factory=list, name="--item", repeat="append")
        hidden: int = 7  # no flag

    p = argparse.ArgumentParser()
    add_flags(p, Knobs)
    assert "--hidden" not in p.format_help()
    args = p.parse_args(["--width", "5", "--no-on", "--item", "x", "--item", "y"])
    assert Knobs(**values_from_args(Knobs, args)) == Knobs(5, 0.5, "a", False, ["x", "y"])
    with pytest.raises(SystemExit):
        p.parse_args(["--name", "c"])
    overlay = argparse.ArgumentParser()
    add_flags(overlay, Knobs, overlay=True)
    assert "how wide (default 3)" in " ".join(overlay.format_help().split())
    assert values_from_args(Knobs, overlay.parse_args(["--ratio", "1"]), overlay=True) == {
        "ratio": 1.0
    }
    assert Flag().repeat is None
