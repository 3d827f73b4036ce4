#!/usr/bin/env bash
# The CUDA path's checks on a machine with a GPU, in one run: the Triton kernels' tests on the
# device, the engine on CUDA against transformers, and the GPU benchmarks. Logs and results go
# to $OUT (default ./gpu-out). Python packages the machine lacks may be carried as wheels in
# .whl/ (installed into /tmp/site); the repository is installed into /tmp/pd without a network.
#
#   bash scripts/gpu/device_checks.sh [kernels,parity,bench]
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
STEPS=${1:-kernels,parity,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PDPOOL_TEST_MODELS=/tmp/pdpool-models
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "carried wheels did not install"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
# pdpool.<folder> maps onto the repository's top folders (setup.py); links do it without pip.
rm -rf /tmp/pd && mkdir -p /tmp/pd && cp -r pdpool /tmp/pd/pdpool
for d in engine kernels sidecar operator; do ln -s "$PWD/$d" "/tmp/pd/pdpool/$d"; done
export PYTHONPATH=/tmp/pd:$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.log"

step() { [[ ",$STEPS," == *",$1,"* ]]; }
rc=0
if step kernels; then
  timeout 240 $PY -m pytest -q -p no:cacheprovider tests/kernel_ops 2>&1 | tee "$OUT/kernels.log" | tail -30
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if step parity; then
  timeout 180 $PY -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda_parity.py 2>&1 | tee "$OUT/parity.log" | tail -30
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if step bench; then
  for b in kernels_decode_attention kernels_prefill_attention kernels_gdn_decode engine_decode_triton; do
    echo "== $b"; timeout 150 $PY benchmarks/$b.py 2>&1 | tail -40
  done 2>&1 | tee "$OUT/bench.log"
  tar czf "$OUT/results.tgz" benchmarks/results/*.json 2>/dev/null
fi
echo "device checks: exit $rc"
exit $rc
