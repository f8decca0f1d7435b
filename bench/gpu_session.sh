#!/usr/bin/env bash
# Every GPU check of the project in one command, for a GPU machine lent for minutes: the gpu-marked
# tests, then `bench gpu`'s parts, each under its own time limit, logs and results written as they
# come.  Run from the project root:
#
#   OUT=/some/dir PARTS=training,bf16 bench/gpu_session.sh
#
# OUT (default results/gpu_logs/<date>): where logs and results go; the parts not run keep their rows
# from results/gpu.json.  PARTS: the parts of `bench gpu` (default: training,bf16,strategies,transfer).  TESTS,
# TESTS_K: test files and pytest's -k (default: the gpu-marked tests of two files, but the search's).  TEST_S, BENCH_S: seconds for the
# tests and the benchmark (TEST_S=0: no tests).  BENCH_ARGS: more arguments of `python -m taskrt.bench.gpu`.
# SCALING_S (default 0: not run): seconds for `bench scaling_measured` on the host's cores after the GPU
# parts (CPU workers; SCALING_ARGS, e.g. --quick), its record and log in one archive (scaling_measured.tar.gz).
# The traces come back as one archive (gpu_traces.tar.gz).
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
# Not installed here (the image's cupy does not match the gpu extra): the checkout's ops/, search/ and
# bench/ are taskrt.ops, taskrt.search and taskrt.bench through links beside taskrt's own rooms
for room in ops search bench; do [ -e "taskrt/$room" ] || ln -s "../$room" "taskrt/$room"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
[ -f "$OUT/gpu.json" ] || [ ! -f results/gpu.json ] || cp results/gpu.json "$OUT/"
if [ "${TEST_S:-180}" != 0 ]; then
  echo "== tests ($(date -u +%T))"
  # shellcheck disable=SC2086
  timeout "${TEST_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::DeprecationWarning \
    -k "${TESTS_K:-not search}" ${TESTS:-tests/test_gpu.py tests/test_torch_kernels.py tests/test_optim.py} 2>&1 \
    | tee "$OUT/pytest.txt" | tail -n 25
fi
echo "== bench.gpu --parts ${PARTS:-training,bf16,strategies,transfer} ($(date -u +%T))"
# shellcheck disable=SC2086
timeout "${BENCH_S:-420}" python3 -m taskrt.bench.gpu --parts "${PARTS:-training,bf16,strategies,transfer}" --out "$OUT" \
  ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
echo "bench exit $?"
grep -E "^\[bench gpu\]|Error|error" "$OUT/bench.txt" | tail -n 60
if [ -d "$OUT/gpu_traces" ]; then
  tar -czf "$OUT/gpu_traces.tar.gz" -C "$OUT" gpu_traces && rm -r "$OUT/gpu_traces"
fi
if [ "${SCALING_S:-0}" != 0 ]; then
  echo "== bench scaling_measured ($(date -u +%T))"
  mkdir -p "$OUT/scaling_measured"
  # shellcheck disable=SC2086
  timeout "$SCALING_S" python3 -m taskrt.bench scaling_measured --out "$OUT/scaling_measured" ${SCALING_ARGS:-} \
    > "$OUT/scaling_measured/log.txt" 2>&1
  echo "scaling_measured exit $?"
  grep -E "^- " "$OUT/scaling_measured/scaling_measured.md" 2>/dev/null | head -n 20
  tar -czf "$OUT/scaling_measured.tar.gz" -C "$OUT" scaling_measured && rm -r "$OUT/scaling_measured"
fi
echo "== done ($(date -u +%T))"
