#!/usr/bin/env bash
# Every GPU check of the project in one command, for a GPU machine lent for minutes: the gpu-marked
# tests, then `bench gpu`'s parts, each under its own time limit, logs and results written as they
# come.  Run from the project root:
#
#   OUT=/some/dir PARTS=training,bf16 bench/gpu_session.sh
#
# OUT (default results/gpu_logs/<date>): where logs and results go.  PARTS: the parts of `bench gpu`
# (default: training,bf16,strategies).  TEST_S, BENCH_S: seconds for the tests and the benchmark.
# Wheels the machine lacks (dask, distributed, ...: see the GPU machine's README) are installed from
# .whl/ when that folder is there.
set -uo pipefail
OUT=${OUT:-results/gpu_logs/$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || { echo "installing the wheels in .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
echo "== tests ($(date -u +%T))"
timeout "${TEST_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/test_gpu.py tests/test_torch_kernels.py 2>&1 | tee "$OUT/pytest.txt" | tail -n 25
echo "== bench.gpu --parts ${PARTS:-training,bf16,strategies} ($(date -u +%T))"
timeout "${BENCH_S:-420}" python3 -m bench.gpu --parts "${PARTS:-training,bf16,strategies}" --out "$OUT" \
  > "$OUT/bench.txt" 2>&1
echo "bench exit $?"
grep -E "^\[bench gpu\]|Error|error" "$OUT/bench.txt" | tail -n 60
echo "== done ($(date -u +%T))"
