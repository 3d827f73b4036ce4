"""The images scripts/images/build.sh makes: every role's entrypoint starts as the image's
non-root user on a read-only root filesystem with no network, and the slim image has no
torch. (That the engine serves under the restricted profile: test_pool.py, on a real node.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster.conftest import ENGINE, SLIM, images, require_root

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.waits_for_build("images/build.sh"),
]


def run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", os.path.expanduser("~/.cache/pdpool/images/containers.conf"))
    cmd = [
        "podman",
        "run",
        "--rm",
        "--read-only",
        "--network=none",
        "--runtime=runc",
        "--tmpfs",
        "/tmp:rw,size=64m",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
    ]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return subprocess.run(
        [*cmd, image, *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module", autouse=True)
def built():
    require_root()
    images()


@pytest.mark.parametrize(
    ("image", "role"),
    [
        (ENGINE, "serve"),
        (ENGINE, "sidecar"),
        (ENGINE, "gateway"),
        (SLIM, "sidecar"),
        (SLIM, "gateway"),
        (SLIM, "epp"),
        (SLIM, "operator"),
    ],
)
def test_every_role_starts_non_root_on_a_read_only_root(image, role):
    done = run(image, role, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


@pytest.mark.parametrize("image", [ENGINE, SLIM])
def test_images_run_as_65532_with_caches_under_tmp(image):
    # getpass: kopf (the operator) names itself after the user, which must exist.
    code = (
        "import getpass, os; print(os.getuid(), getpass.getuser(), os.environ['HOME'], "
        "os.environ['XDG_CACHE_HOME'], os.environ['HF_HOME'])"
    )
    done = run(image, "-c", code, entrypoint="python3")
    assert done.returncode == 0, done.stderr
    uid, user, home, xdg, hf = done.stdout.split()
    assert uid == "65532" and user == "pdpool" and home == "/tmp"
    assert xdg.startswith("/tmp/") and hf.startswith("/tmp/")


def test_slim_image_has_no_torch_and_the_engine_image_has_it():
    assert run(SLIM, "-c", "import torch", entrypoint="python3").returncode != 0
    done = run(
        ENGINE, "-c", "import torch, triton, nixl; print(torch.__version__)", entrypoint="python3"
    )
    assert done.returncode == 0, done.stderr[-2000:]
