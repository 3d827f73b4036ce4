"""Every repository path the README and docs/ name in backticks exists: a module moved or
renamed takes its mentions along (`sidecar/proxy/app.py`, not a `proxy.py` that is gone)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = (
    ".ci/",
    "benchmarks/",
    "charts/",
    "crds/",
    "devtools/",
    "docs/",
    "engine/",
    "images/",
    "kernels/",
    "operator/",
    "pdpool/",
    "scripts/",
    "sidecar/",
    "tests/",
)
SPAN = re.compile(r"`([^`\s]+)`")
# Written by the benchmarks (git-ignored): named as where results land, not as sources.
GENERATED = "benchmarks/results/"


def tracked() -> tuple[set[str], set[str]]:
    """The repository's files, and every folder that holds one."""
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = set(done.stdout.split())
    folders = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
    return files, folders


def named_paths(text: str) -> list[str]:
    """Backticked spans that name a path under a top-level folder (`engine/config.py`,
    `sidecar/kv/`, `tests/x.py::test_y`, `pdpool/cli.py:42`); patterns are left out."""
    out = []
    for span in SPAN.findall(text):
        path = re.split(r"[:#]", span.rstrip(".,;)"))[0]
        if path.startswith(TOPS) and not re.search(r"[*{}<>$|]", path):
            out.append(path.rstrip("/"))
    return out


def test_every_named_path_exists():
    files, folders = tracked()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for doc in docs:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in named_paths(line):
                if path in files or path in folders or path.startswith(GENERATED.rstrip("/")):
                    continue
                missing.append(f"{doc.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "paths named in the docs that the repository lacks:\n" + "\n".join(missing)


def test_the_scan_finds_paths_and_leaves_out_patterns():
    line = (
        "see `engine/config.py`, `sidecar/kv/`, `tests/test_x.py::test_y`, `pdpool/cli.py:42`,"
        " `engine/*.py`, `--flag`, `docs/<name>.md` and `proxy.py`"
    )
    assert named_paths(line) == [
        "engine/config.py",
        "sidecar/kv",
        "tests/test_x.py",
        "pdpool/cli.py",
    ]
