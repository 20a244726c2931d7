#!/usr/bin/env bash
# Install veoptim (not editable) into a fresh virtual environment and run its commands
# from outside the checkout: what a user gets from `pip install .`. The test suite runs
# from the checkout, so a config or asset missing from the package passes there.
#
#   scripts/check_install.sh            # CI runs it after `make test` (.ci/run)
#   PYTHON=python3.11 scripts/check_install.sh
#
# The build reads a copy of the checkout's files (tracked and not ignored), so it writes
# no build/ or egg-info into the checkout. Needs the package index (pip), as `make setup`.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fail() {
  echo "check_install: FAILED: $*" >&2
  exit 1
}

echo "check_install: copying $REPO and installing it into a fresh venv in $WORK"
mkdir "$WORK/src"
(
  cd "$REPO"
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -
) | tar -xf - -C "$WORK/src"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$WORK/src[plots]" ||
  fail "pip install of the package failed"
SITE=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for generic in tasks callbacks; do
  [ ! -e "$SITE/$generic" ] || fail "the package installed a top-level '$generic' into $SITE"
done

# Outside the checkout, with nothing of it on the path: only the installed package counts.
cd "$WORK"
unset PYTHONPATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1
BIN="$WORK/venv/bin"

for command in veoptim-sft veoptim-dpo veoptim-multi-lora veoptim-export veoptim-serve \
  veoptim-generate veoptim-sweep-report; do
  "$BIN/$command" --help >"$WORK/help.txt" 2>&1 || fail "$command --help exited with $?"
  grep -q "^usage: $command" "$WORK/help.txt" || fail "$command --help printed no usage line"
done
grep -q "^    train.max_steps: int = " <("$BIN/veoptim-sft" --help) ||
  fail "veoptim-sft --help does not list train.max_steps with its type and default"

"$BIN/veoptim-sft" train.max_steps=5 run.dir="$WORK/run" logging.progress=false ||
  fail "veoptim-sft train.max_steps=5 exited with $?"
[ -f "$WORK/run/checkpoints/step_00000005/checkpoint.json" ] ||
  fail "no checkpoint at $WORK/run/checkpoints/step_00000005"
[ -f "$WORK/run/exports/hf_final/config.json" ] ||
  fail "no Hugging Face export at $WORK/run/exports/hf_final"
[ -f "$WORK/run/sft.log" ] || fail "no run log at $WORK/run/sft.log"

"$BIN/veoptim-sweep-report" "$WORK/run" --out "$WORK/report" >"$WORK/report.txt" ||
  fail "veoptim-sweep-report exited with $?"
for f in sweep.md sweep.csv loss.png; do
  [ -s "$WORK/report/$f" ] || fail "veoptim-sweep-report wrote no $WORK/report/$f"
done

echo "check_install: OK (installed commands run from $WORK: help, a 5-step SFT run, its checkpoint and export, its sweep report; no top-level tasks/callbacks)"
