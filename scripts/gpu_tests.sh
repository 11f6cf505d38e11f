#!/usr/bin/env bash
# The test suite in N pytest processes at once (default: one per CPU core). On the GPU
# machine they share its one GPU: most of the suite's time there is numba compiling kernel
# variants, one CPU core a process, so N processes finish in a fraction of one process's time.
#
#     bash scripts/gpu_tests.sh [N] [pytest options...]
#
# Where pytest-xdist >= 3.2 is installed (the GPU machine has it), one pytest runs N workers
# with work stealing (`--dist worksteal`): each worker starts on a contiguous run of the
# collected tests (neighbouring tests share kernel variants, so a worker compiles few), and
# a worker that is done takes the second half of a busy one's remaining run. Otherwise
# (SLICES=1 forces it) N pytest processes each run a fixed contiguous slice of about equal
# estimated time.
#
# Python: $PYTHON (default python3). Tests: $TESTS (default: tests; any pytest paths).
# Logs go to $LOGS (default: a new temporary directory), written unbuffered so that a
# stopped run still shows how far it got. $SLICE_TIMEOUT (seconds, default none) stops the
# run (or a slice) that runs longer, so that the summary still prints inside a device
# command's limit. Prints the summary (each slice's, then the totals); exits non-zero when
# a test fails, the run times out or nothing was collected.
set -uo pipefail
n=${1:-$(nproc)}
shift || true
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
# One BLAS/OpenMP thread a slice: N slices of a BLAS that each start a thread per core
# oversubscribe the machine (the likely reason the 1-second digits-demo test overran a slice there).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} \
       MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
"${PYTHON:-python3}" -m pytest --collect-only -q -p no:cacheprovider "$@" ${TESTS:-tests} | grep '::' > "$logs/ids"
total=$(wc -l < "$logs/ids")
if [ "$total" -eq 0 ]; then
  echo "gpu_tests: no tests collected" >&2
  exit 1
fi
[ "$n" -gt "$total" ] && n=$total
py=${PYTHON:-python3}
if [ "${SLICES:-0}" != 1 ] && "$py" -c 'import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split(".")[:2])) < (3, 2))' 2>/dev/null; then
  start=$(date +%s)
  # -v: one line a test as it ends, so that a run stopped by the timeout still counts.
  timeout "${SLICE_TIMEOUT:-0}" "$py" -m pytest -n "$n" --dist worksteal -v -p no:cacheprovider "$@" \
    ${TESTS:-tests} > "$logs/all.log" 2>&1
  rc=$?
  count() { grep -cE "^\[gw[0-9]+\] \[ *[0-9]+%\] $1 " "$logs/all.log"; }
  [ "$rc" = 124 ] && echo "timed out after ${SLICE_TIMEOUT}s"
  tail -n 1 "$logs/all.log"
  echo "gpu_tests: $total collected, $n workers, $(count PASSED) passed, $(count FAILED) failed," \
       "$(count SKIPPED) skipped, $(count ERROR) errors in $(( $(date +%s) - start )) s (logs: $logs)"
  exit $rc
fi
# Contiguous slices of about equal estimated time, not equal counts: a test that runs the
# CUDA backend compiles kernel variants (seconds each, the suite's time), the rest take
# milliseconds. Equal counts left 4 of 16 slices past 310 s and 5 done within 10 s (H200).
awk -v n="$n" -v dir="$logs" '
  function weight(id) { return id ~ /test_cuda(_kernels)?\.py::/ ? 10 : (id ~ /cuda|demo/ ? 5 : 0.3) }
  { ids[NR] = $0; total += weight($0) }
  END {
    for (i = 1; i <= NR; i++) {
      k = int(cum * n / total); if (k > n - 1) k = n - 1
      printf "%s\n", ids[i] > sprintf("%s/slice.%03d", dir, k)
      cum += weight(ids[i])
    }
  }' "$logs/ids"
start=$(date +%s)
for f in "$logs"/slice.???; do
  (
    mapfile -t ids < "$f"
    timeout "${SLICE_TIMEOUT:-0}" "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@" "${ids[@]}" > "$f.log" 2>&1
    echo $? > "$f.rc"
  ) &
done
wait
status=0
for f in "$logs"/slice.???; do
  rc=$(cat "$f.rc" 2>/dev/null || echo missing)
  last=$(tail -n 1 "$f.log")
  [ "$rc" = 124 ] && last="timed out after ${SLICE_TIMEOUT}s; last output: ${last: -200}"
  echo "$(basename "$f") rc=$rc: $last"
  [ "$rc" = 0 ] || status=1
done
sum() { grep -ohE "[0-9]+ $1" "$logs"/slice.???.log | awk '{s += $1} END {print s + 0}'; }
echo "gpu_tests: $total collected in $n slices, $(sum passed) passed, $(sum failed) failed," \
     "$(sum skipped) skipped, $(sum error) errors in $(( $(date +%s) - start )) s (logs: $logs)"
exit $status
