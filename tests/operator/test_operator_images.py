"""What can be checked of the images without a Docker engine."""

import re
import subprocess
import sys

import pytest

from devtools.operator_kube import PDPOOL, REPO

IMAGES = REPO / "images"


def copied_sources(dockerfile):
    sources = []
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"COPY\s+(?!--from)(.+)\s+(\S+)$", line.strip())
        if m:
            sources += m.group(1).split()
    return sources


@pytest.mark.parametrize("name", ["engine.Dockerfile", "slim.Dockerfile"])
def test_images_copy_every_package_folder_that_setup_maps(name):
    text = (REPO / "setup.py").read_text()
    folders = set(re.findall(r'"pdpool[.\w]*":\s*"(\w+)"', text))
    sources = copied_sources(IMAGES / name)
    assert folders and folders <= set(sources), f"{name} misses {folders - set(sources)}"
    for src in sources:
        if "*" not in src:
            assert (REPO / src).exists(), f"{name} copies missing {src}"
    ignore = (IMAGES / f"{name}.dockerignore").read_text().split()
    for folder in folders:
        assert f"!{folder}/**" in ignore


def test_slim_image_leaves_the_engine_extra_out():
    text = (IMAGES / "slim.Dockerfile").read_text()
    assert '"/src[operator]"' in text and "engine]" not in text
    engine = (IMAGES / "engine.Dockerfile").read_text()
    # The engine image runs every role (the operator's extra is small); the slim one no engine.
    assert '"/src[engine,nixl,operator]"' in engine


def test_operator_imports_and_runs_its_cli_without_torch():
    # What the slim image relies on: torch made unimportable, the operator still loads.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdpool.operator.handlers, pdpool.operator.builders\n"
        "from pdpool.cli import main; sys.exit(main(['operator', '--help']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--all-namespaces" in proc.stdout


def test_operator_cli_bad_kubeconfig_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [*PDPOOL, "operator", "--kubeconfig", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr
