"""pdpool/command_lines.py is the one place that writes the flags of a pool's processes
(`pdpool serve`, `sidecar`, `gateway`, `epp`): the operator (operator/) and `pdpool up`
(pdpool/up/) fill its launch records and never spell one of those flags themselves, so a
pool cannot run with different flags one way or the other. Static: the source is read."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from pdpool.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
# Modules that define a command line of their own (`pdpool operator`, `pdpool up`) or start
# a third party's (Envoy): the flags they name are not a pool process's.
OWN_COMMANDS = {"operator/operator_cli.py", "pdpool/up/cli.py", "pdpool/up/envoy_gateway.py"}
FILLERS = sorted(
    p
    for p in [*(ROOT / "operator").glob("*.py"), *(ROOT / "pdpool" / "up").glob("*.py")]
    if str(p.relative_to(ROOT)) not in OWN_COMMANDS
)
# Flags these modules may name without writing them to a pool process's command line.
READ_ONLY = {
    # reads the thread flags a user passed through --engine-arg (pdpool/up/topology.py)
    "--cpu-threads",
    "--cpu-prefill-threads",
    # reads the engines' last --block-size (command_lines.last_flag_value)
    "--block-size",
}
# Stock vLLM's CPU settings for local runs, handed to the renderer as VllmLaunch.vllm_args.
LOCAL_VLLM = {"--dtype", "--enforce-eager", "--max-model-len"}


def pool_flags() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = set()
    for command in ("serve", "sidecar", "gateway", "epp"):
        for action in sub.choices[command]._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags - {"--help"}


def written_flags(path: Path, flags: set[str]) -> list[str]:
    """String pieces (f-string parts too) that are one of `flags`, or one with `=value`;
    docstrings and help texts are prose and never equal a flag."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            name = text.split("=", 1)[0]
            if name in flags and (text == name or "=" in text):
                found.append(f"{path.name}:{node.lineno}: {text}")
    return found


def test_only_the_renderer_writes_a_pool_process_flag():
    flags = pool_flags() - READ_ONLY - LOCAL_VLLM
    assert len(flags) > 100
    found = [hit for path in FILLERS for hit in written_flags(path, flags)]
    assert not found, "flags written outside pdpool/command_lines.py:\n" + "\n".join(found)


def test_the_scan_sees_plain_and_formatted_flags(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""--mode in a docstring is prose."""\n'
        'a = ["--mode", "x"]\n'
        'b = f"--max-loras={2}"\n'
        'c = "use --mode to choose"\n'
    )
    hits = written_flags(module, {"--mode", "--max-loras"})
    assert [h.rsplit(": ", 1)[1] for h in hits] == ["--mode", "--max-loras="]
