"""fp16 (FP32 masters, dynamic loss scaling) against bf16: step time and skipped steps.

Each variant trains the bundled tiny model for ``--steps`` steps (default 200) with
``master_fp32_adamw`` in a fresh ``python -m tasks.sft`` process, the same data and seed,
rounds interleaved. From each run's metrics.jsonl:

* ``step_s``: the median ``step_time_s`` of the steps after the first two;
* ``skipped_fraction`` (fp16): the steps the loss scaler skipped, over all steps;
* ``final_loss``: the mean loss of the last 10 steps, and the final ``loss_scale``.

Prints one JSON object with the medians over ``--repeats`` rounds and fp16 / bf16 ratios.

    .venv/bin/python scripts/bench/fp16.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "bf16": ["model.dtype=bf16"],
    "fp16": ["model.dtype=fp16", "parallel.param_dtype=fp16"],
}


def run(name: str, run_dir: Path, steps: int) -> dict:
    overrides = [*VARIANTS[name], "optim=master_fp32_adamw", f"train.max_steps={steps}",
                 f"run.dir={run_dir}", "run.device=cpu", "logging.progress=false",
                 "logging.level=WARNING", "export.hf=false",
                 "checkpoint.save_at_end=false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tasks.sft", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records[2:]),
        "skipped_fraction": last.get("skipped_steps", 0) / len(records),
        "final_loss": statistics.mean(r["loss"] for r in records[-10:]),
        "final_loss_scale": last.get("loss_scale"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="fp16_bench_") as tmp:
        for i in range(args.repeats):
            for name in VARIANTS:
                rounds[name].append(run(name, Path(tmp) / f"{name}_{i}", args.steps))
    result: dict = {"benchmark": "fp16", "model": "tiny_dense", "steps": args.steps,
                    "repeats": args.repeats}  # fmt: skip
    for name, runs in rounds.items():
        result[name] = {key: statistics.median(r[key] for r in runs if r[key] is not None)
                        if any(r[key] is not None for r in runs) else None
                        for key in runs[0]}  # fmt: skip
    result["ratio"] = {"step_s": result["fp16"]["step_s"] / result["bf16"]["step_s"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
