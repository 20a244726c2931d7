"""Plot RL runs' reward and accuracy per step from their ``metrics.jsonl``.

    .venv/bin/python scripts/plot_rl.py recipe=runs/rl sdk_ppo=runs/rl_sdk \\
        --out docs/images/rl_arithmetic.png [--smooth 5]

Each argument is a run directory (or its ``metrics.jsonl``), optionally labelled
``LABEL=PATH``. The steps that have ``env/all/reward/total`` are read: the cookbook's
``math_rl`` recipe writes them, and so does ``scripts/rl_sdk.py``. Two panels, mean reward
(``env/all/reward/total``) and share of correct answers (``env/all/correct``) against the
step: each step thin, and its trailing moving average over ``--smooth`` steps bold.
Needs matplotlib (``pip install 'veoptim[plots]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REWARD = "env/all/reward/total"
CORRECT = "env/all/correct"
PANELS = ((REWARD, "mean reward"), (CORRECT, "share of right answers"))
SIZE_IN, DPI = (10.0, 4.0), 100


def metrics_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def read_run(path: Path) -> dict[int, dict[str, float]]:
    """Step -> that step's metrics, for the steps with a reward (the last line of a step wins)."""
    rows = {}
    for line in metrics_file(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if REWARD in row:
                rows[int(row["step"])] = row
    if not rows:
        raise SystemExit(f"{metrics_file(path)} has no step with {REWARD}")
    return dict(sorted(rows.items()))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average fewer)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / min(i + 1, window)
            for i in range(len(values))]  # fmt: skip


def parse_run(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    if not sep:
        path = arg
        label = Path(arg).name if Path(arg).is_dir() else Path(arg).parent.name
    return label, Path(path)


def figure(runs: dict[str, dict[int, dict[str, float]]], window: int):
    from matplotlib.figure import Figure  # not pyplot: no global state, no GUI backend

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for i, (label, rows) in enumerate(runs.items()):
            steps = [step for step, row in rows.items() if key in row]
            values = [rows[step][key] for step in steps]
            color = f"C{i}"
            ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.35)
            ax.plot(steps, smooth(values, window), color=color, linewidth=2, label=label)
        ax.set(title=title, xlabel="step", ylabel=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if window > 1:
        fig.suptitle(f"thin: each step; bold: moving average over {window} steps", fontsize="small")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="[LABEL=]PATH", help="run dir or metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--smooth", type=int, default=5, metavar="N", help="moving average")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: works without a display
    except ImportError:
        print("matplotlib is not installed (pip install 'veoptim[plots]').", file=sys.stderr)
        return 2
    runs = {label: read_run(path) for label, path in map(parse_run, args.runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, max(1, args.smooth)).savefig(args.out, dpi=DPI)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
