"""Random JSON schemas (devtools/schema_fuzz.py) against each grammar: how many random
sentences of it fail strict json.loads or jsonschema, how many schemas it refuses (a 400),
and for vLLM how many it hands to another backend. Validity is not a timing: a loaded
machine only slows it.

    python benchmarks/schema_fuzz.py                      # ours, xgrammar as installed
    python benchmarks/schema_fuzz.py --vllm               # and vLLM 0.32's, in its venv

The sentences are walks over each grammar's token masks on the tiny Qwen3 tokenizer
(vocabulary 512, byte-level), every token drawn at random from those allowed: what a model
could write at temperature 1, without a model. `pdpool` is the engine's grammar with free
whitespace (the default), `pdpool-compact` without; `xgrammar` is xgrammar's own grammar of
the schema; `vllm` runs in vLLM's venv (scripts/vllm/build-venv.sh) with its xgrammar, and
its `has_xgrammar_unsupported_json_features` sends a schema to another backend (not judged
here). Results: benchmarks/results/schema_fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from benchmarks.structured_validity import tiny_model
from devtools.schema_fuzz import GRAMMARS, Walker, fuzz
from pdpool.up.topology import vllm_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tally_here(grammar: str, model: str, seed: int, args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    walker = Walker(AutoTokenizer.from_pretrained(model), vocab_size=512)
    return asdict(fuzz(walker, GRAMMARS[grammar](), seed, args.schemas, args.walks))


def tally_in_vllm_venv(model: str, seed: int, args) -> dict[str, Any]:
    python = os.path.join(os.path.dirname(vllm_command()), "python")
    if not os.access(python, os.X_OK):
        sys.exit(f"no vLLM venv at {python}: run scripts/vllm/build-venv.sh")
    command = [python, "-m", "devtools.schema_fuzz", "--grammar", "vllm", "--tokenizer", model]
    command += ["--seed", str(seed), "--schemas", str(args.schemas), "--walks", str(args.walks)]
    out = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}
    )
    if out.returncode != 0:
        sys.exit(f"the vLLM walk failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def row(grammar: str, tallies: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [b for t in tallies for b in t["bad"]]
    kinds = Counter("not JSON" if why.startswith("not JSON") else "invalid" for why, _, _ in bad)
    sentences = sum(t["sentences"] for t in tallies)
    return {
        "grammar": grammar,
        "schemas": sum(t["schemas"] for t in tallies),
        "refused": sum(t["refused"] for t in tallies),
        "other backend": sum(t["other_backend"] for t in tallies),
        "sentences": sentences,
        "not JSON": kinds["not JSON"],
        "invalid": kinds["invalid"],
        "valid %": round(100 * (1 - len(bad) / sentences), 2) if sentences else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=3000, help="per seed")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--walks", type=int, default=4, help="sentences tried per schema")
    parser.add_argument("--vllm", action="store_true", help="also vLLM's grammar, in its venv")
    args = parser.parse_args()
    model = tiny_model()
    seeds = [int(s) for s in args.seeds.split(",")]
    grammars = ["pdpool", "pdpool-compact", "xgrammar"] + (["vllm"] if args.vllm else [])
    rows, examples = [], {}
    for grammar in grammars:
        tallies = [
            tally_in_vllm_venv(model, seed, args)
            if grammar == "vllm"
            else tally_here(grammar, model, seed, args)
            for seed in seeds
        ]
        rows.append(row(grammar, tallies))
        examples[grammar] = [b for t in tallies for b in t["bad"]][:20]
    print_table(rows, f"random schemas: {args.schemas} per seed, seeds {seeds}, {args.walks} walks")
    write_json("schema_fuzz", {"args": vars(args), "rows": rows, "failures": examples})


if __name__ == "__main__":
    main()
