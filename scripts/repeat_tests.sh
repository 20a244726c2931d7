#!/usr/bin/env bash
# Run a pytest selection N times in a row and stop at the first failing run, to show that a
# multi-rank spawn is free of rare crashes (a rank lost to SIGABRT at teardown, say).
#   scripts/repeat_tests.sh 200 tests/checkpoint/test_checkpoint_agreement.py
# Each failing run's output is kept in $REPEAT_DIR (default /tmp/veoptim-repeat); core files
# land there too when `ulimit -c unlimited` is allowed (inspect with gdb -batch -ex "thread
# apply all bt" .venv/bin/python core).
set -uo pipefail
if [ "$#" -lt 2 ]; then
  echo "usage: $0 N PYTEST_ARGS..." >&2
  exit 2
fi
n=$1
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
dir="${REPEAT_DIR:-/tmp/veoptim-repeat}"
mkdir -p "$dir"
ulimit -c unlimited 2>/dev/null || true
export OMP_NUM_THREADS=1
start=$(date +%s)
for i in $(seq 1 "$n"); do
  run="$dir/run$i"
  mkdir -p "$run"
  if ! (cd "$run" && "$py" -m pytest -q -p no:cacheprovider --rootdir "$root" \
      -c "$root/pyproject.toml" "${@/#tests/$root/tests}" >out.txt 2>&1); then
    echo "run $i of $n failed after $(($(date +%s) - start)) s; output in $run/out.txt" >&2
    grep -m3 -E "SIGABRT|terminate called|Error" "$run/out.txt" >&2
    exit 1
  fi
  rm -rf "$run"
done
echo "$n of $n runs passed in $(($(date +%s) - start)) s: $*"
