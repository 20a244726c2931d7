#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (under 8 minutes on one GPU), one JSON out:
#   1. tests/accelerator with VEOPTIM_REQUIRE_CUDA=1 (a skipped CUDA test fails);
#   2. scripts/bench/optimizer_step.py on a ~1e9-parameter state on cuda: full_fp32_adamw
#      (compiled kernel, and eager) and master_fp32_adamw vs torch.optim.AdamW(fused=True),
#      cpu_offload_adamw vs the resident step and vs the host update alone;
#   3. scripts/bench/checkpoint_io.py (CPU-side checkpoint I/O; it takes no device);
#   4. scripts/bench/qlora.py on the device: QLoRA against BF16 LoRA (GPU memory, step time).
#
#   scripts/accelerator_check.sh OUT_DIR               # on a GPU machine
#   scripts/accelerator_check.sh OUT_DIR --cpu-smoke   # same pipeline, CPU, tiny sizes
#
# Writes OUT_DIR/accelerator_check.json: GPU name (nvidia-smi), torch version, the
# interpreter and its packages' versions, whether a C compiler was found, each step's
# return code, seconds and results (pytest counts, both benchmarks' JSON), and copies
# each step's log (and the tests' JUnit XML) beside it. Exits non-zero when a step failed.
#
# The interpreter: PY=/path/to/python (or a command name, e.g. PY=python3) runs every
# step with that interpreter and installs nothing. The checkout needs no installation
# then: the script appends the repository root to PYTHONPATH (veoptim, tasks, callbacks
# and configs/ are found from there), so that interpreter needs only the project's
# imports of these steps: torch, transformers, tokenizers, safetensors, hydra-core,
# omegaconf, numpy, pytest, psutil, bitsandbytes (the QLoRA tests). On a machine without a network, carry what it lacks
# as wheels, install them with `pip install --target DIR` and put DIR first in PYTHONPATH.
# Without PY, the script uses .venv/bin/python, creating .venv (`pip install -e .[dev,quant]`,
# as `make setup`, with the quant extra) when it is absent.
#
# With no C compiler the CPU AdamW kernel falls back to the eager engine (same results);
# the compiled CUDA kernel (torch.compile: Triton needs a C compiler and Python's headers)
# has no silent fallback here: its test fails.
set -uo pipefail

OUT_DIR=${1:?usage: scripts/accelerator_check.sh OUT_DIR [--cpu-smoke]}
SMOKE=0
[ "${2:-}" = "--cpu-smoke" ] && SMOKE=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

if [ -n "${PY:-}" ]; then
  FOUND=$(command -v "$PY") || { echo "accelerator_check: PY=$PY: no such interpreter" >&2; exit 2; }
  PY=$FOUND
else
  PY=.venv/bin/python
  if [ ! -x "$PY" ]; then
    echo "accelerator_check: creating .venv (pip install -e .[dev,quant])"
    ${PYTHON:-python3} -m venv .venv && "$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev,quant]" ||
      { echo "accelerator_check: FAILED to create .venv" >&2; exit 2; }
  fi
fi
# The checkout importable as is (after any wheels the caller put first in PYTHONPATH).
case ":${PYTHONPATH:-}:" in
  *":$REPO:"*) ;;
  *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO" ;;
esac
echo "accelerator_check: python $PY, PYTHONPATH=$PYTHONPATH"
# The imports every step needs, checked once: a missing package is one clear line, not
# three failed steps.
if ! "$PY" -c "import torch, transformers, hydra, omegaconf, pytest, veoptim.optim, tasks.compose" \
  >"$WORK/imports.log" 2>&1; then
  echo "accelerator_check: the interpreter cannot import what the steps need:" >&2
  tail -n 5 "$WORK/imports.log" >&2
  cp "$WORK/imports.log" "$OUT_DIR"/
  exit 2
fi
rm -f "$WORK/imports.log"

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu REQUIRE=0 NUMEL=200000 ROUNDS=2
  VARIANTS=torch_fused_adamw_fp32,full_fp32_adamw_bf16_params,full_fp32_adamw_bf16_params_eager,master_fp32_adamw_bf16_params,cpu_offload_adamw_bf16_params,host_update_bf16_params
  CKPT_ARGS=(--size-mb 5 --repeats 1)
  QLORA_ARGS=(--hidden 256 --intermediate 512 --layers 2 --seq 64 --steps 4 --repeats 1)
  T_TESTS=180 T_OPTIM=120 T_CKPT=120 T_QLORA=120
else
  DEVICE=cuda REQUIRE=1 NUMEL=1073741824 ROUNDS=5 VARIANTS=""
  CKPT_ARGS=(--size-mb 200 --repeats 3)
  QLORA_ARGS=(--steps 8 --repeats 1)
  T_TESTS=180 T_OPTIM=210 T_CKPT=90 T_QLORA=90
fi

# step NAME TIMEOUT_S CMD...: runs CMD, records its return code and milliseconds in $WORK/NAME.rc/.ms
step() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "accelerator_check: $name: $*"
  start=$(date +%s%N)
  timeout -k 15 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  echo "$rc" >"$WORK/$name.rc"
  echo "$((($(date +%s%N) - start) / 1000000))" >"$WORK/$name.ms"
  tail -n 3 "$WORK/$name.log"
  echo "accelerator_check: $name: rc=$rc"
}

step tests "$T_TESTS" env VEOPTIM_REQUIRE_CUDA=$REQUIRE "$PY" -m pytest -q -p no:cacheprovider \
  tests/accelerator --junitxml="$WORK/tests.xml"
step optimizer_step "$T_OPTIM" "$PY" scripts/bench/optimizer_step.py --device "$DEVICE" \
  --numel "$NUMEL" --rounds "$ROUNDS" ${VARIANTS:+--variants "$VARIANTS"} \
  --out "$WORK/optimizer_step.json"
step checkpoint_io "$T_CKPT" "$PY" scripts/bench/checkpoint_io.py "${CKPT_ARGS[@]}"
step qlora "$T_QLORA" "$PY" scripts/bench/qlora.py --device "$DEVICE" "${QLORA_ARGS[@]}"
cp "$WORK"/*.log "$WORK"/tests.xml "$OUT_DIR"/ 2>/dev/null

GPU_NAME=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  head -n 1)
"$PY" - "$WORK" "$OUT_DIR/accelerator_check.json" "$SMOKE" "${GPU_NAME:-none}" <<'EOF'
import json, os, platform, shutil, subprocess, sys, time, xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import torch

work, out, smoke, gpu = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]


def last_json_line(text: str):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


steps = {}
for name in ("tests", "optimizer_step", "checkpoint_io", "qlora"):
    log = (work / f"{name}.log").read_text(errors="replace")
    steps[name] = {
        "rc": int((work / f"{name}.rc").read_text()),
        "seconds": round(int((work / f"{name}.ms").read_text()) / 1000, 1),
    }
    if name == "tests" and (work / "tests.xml").exists():
        suite = ET.parse(work / "tests.xml").getroot().find("testsuite")
        steps[name]["result"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        steps[name]["summary"] = log.strip().splitlines()[-1] if log.strip() else ""
    elif name == "optimizer_step" and (work / "optimizer_step.json").exists():
        steps[name]["result"] = json.loads((work / "optimizer_step.json").read_text())
    else:
        steps[name]["result"] = last_json_line(log)
    if steps[name]["rc"] != 0:
        steps[name]["log_tail"] = log[-3000:]


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def compiler() -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    done = subprocess.run([cc, "--version"], capture_output=True, text=True)
    return f"{cc}: {(done.stdout.splitlines() or ['?'])[0]}"


PACKAGES = ("transformers", "tokenizers", "safetensors", "huggingface-hub", "peft",
            "hydra-core", "omegaconf", "numpy", "triton", "pytest", "bitsandbytes")
report = {
    "check": "accelerator_check",
    "mode": "cpu-smoke" if smoke else "cuda",
    "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "gpu": gpu,
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "python": f"{sys.executable} {platform.python_version()}",
    "pythonpath": os.environ.get("PYTHONPATH", ""),
    "packages": {name: version(name) for name in PACKAGES},
    "cc": compiler(),
    "ok": all(s["rc"] == 0 for s in steps.values()),
    "total_seconds": round(sum(s["seconds"] for s in steps.values()), 1),
    "steps": steps,
}
out.write_text(json.dumps(report, indent=1) + "\n")
print(f"accelerator_check: wrote {out} (ok={report['ok']}, {report['total_seconds']} s)")
sys.exit(0 if report["ok"] else 1)
EOF
