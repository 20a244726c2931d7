"""Tabulate and plot the metrics of the runs of a sweep (or of any run dirs).

    veoptim-sweep-report runs/sft [more run or sweep dirs] [--out DIR] [--metric loss] [--smooth N]

(in a checkout also ``python -m tasks.sweep_report`` or ``python scripts/sweep_report.py``).

Each PATH is a run dir (holds ``metrics.jsonl``), a sweep dir (its job subdirs do), or both
(a sweep written into a run's dir): every run found there is reported.
Runs are labelled by the keys their sweep swept (the ``key=a,b`` overrides of the sweep's
``multirun.yaml``), each with the value the run used: its resolved config's, or its
config group's option; runs of no sweep, by the config keys that differ between them.
Prints a Markdown table
(best final metric first) and writes ``sweep.md``, ``sweep.csv`` and the curves as
``<metric>.png`` (``loss.png``, with matplotlib: ``pip install 'veoptim[plots]'``; without
it the table and CSV are still written) into ``--out`` (default: the first PATH).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS = "metrics.jsonl"
#: Written by Hydra into a sweep's dir: the sweep's command-line overrides.
MULTIRUN_FILE = "multirun.yaml"
#: Written by Hydra into every run's dir: its config group choices (``hydra.runtime.choices``).
HYDRA_FILE = Path(".hydra") / "hydra.yaml"
# Keys that differ between runs by how they were started, never explaining a difference.
IGNORED_KEYS = {"run.dir", "checkpoint.resume", "checkpoint.overwrite"}
#: The PNG's size in pixels (width, height) and resolution.
PNG_SIZE = (900, 500)
DPI = 100


class ReportError(Exception):
    """A user mistake reported as one sentence (exit code 2), not a traceback."""


@dataclass
class Run:
    """One run: its dir, display name, flattened config (None if unknown) and records by step."""

    path: Path
    name: str
    config: dict[str, str] | None
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    label: str = ""
    choices: dict[str, str] = field(default_factory=dict)

    def value(self, key: str) -> str | None:
        """What the run used for ``key``: a config key's value, else a group's option."""
        if self.config is not None and key in self.config:
            return self.config[key]
        return self.choices.get(key)


def _fmt(value: Any) -> str:
    """Format a config value the way one would type it as an override."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return "null" if value is None else str(value)


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested mapping -> ``{"optim.lr": "0.001", ...}``; lists stay one value."""
    if not isinstance(tree, dict):
        return {prefix: _fmt(tree)} if prefix else {}
    flat: dict[str, str] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def load_config(run_dir: Path) -> dict[str, str] | None:
    """The resolved ``config.yaml`` flattened, else the command-line overrides, else None."""
    try:
        if (run_dir / "config.yaml").is_file():
            return flatten(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            items = yaml.safe_load(overrides.read_text()) or []
            return dict(str(item).lstrip("+~").partition("=")[::2] for item in items)
    except yaml.YAMLError:
        pass  # an unreadable config only costs the label, never the report
    return None


def _yaml(path: Path) -> Any:
    """A YAML file's content; None when it is missing or unreadable (it only costs labels)."""
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None


def load_choices(run_dir: Path) -> dict[str, str]:
    """The run's config group options (``optim: adamw``, ...), from Hydra's record of it."""
    hydra = (_yaml(run_dir / HYDRA_FILE) or {}).get("hydra") or {}
    choices = (hydra.get("runtime") or {}).get("choices") or {}
    return {str(k): _fmt(v) for k, v in choices.items() if not str(k).startswith("hydra/")}


def swept_keys(sweep_dir: Path) -> list[str]:
    """The keys a sweep written into ``sweep_dir`` swept (its ``key=a,b`` overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    hydra = (_yaml(sweep_dir / MULTIRUN_FILE) or {}).get("hydra") or {}
    lines = [str(line) for line in (hydra.get("overrides") or {}).get("task") or []]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
    except HydraException:
        return []
    return [o.get_key_element().lstrip("+~") for o in overrides if o.is_sweep_override()]


def load_metrics(path: Path, metric: str = "loss") -> dict[int, dict[str, Any]]:
    """Records by step; a resumed run appends to the same file, so the later record wins."""
    records: dict[int, dict[str, Any]] = {}
    text = path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                # a run killed mid-write leaves a torn last line; its resume drops it
                print(f"warning: skipping the torn last line {where}", file=sys.stderr)
                continue
            raise ReportError(f"{where} is not valid JSON") from None
        if not isinstance(record, dict):
            raise ReportError(f"{where} is not a JSON object")
        for key in ("step", metric):
            if key not in record:
                raise ReportError(f"{where} has no '{key}' (keys: {', '.join(record)})")
        if not isinstance(record["step"], int) or isinstance(record["step"], bool):
            raise ReportError(f"{where} has a non-integer step {record['step']!r}")
        records[record["step"]] = record
    return dict(sorted(records.items()))


def load_run(run_dir: Path, metric: str = "loss", name: str | None = None) -> Run:
    """Read one run dir: metrics plus config (for the label)."""
    run = Run(run_dir, name or run_dir.name, load_config(run_dir), choices=load_choices(run_dir))
    run.records = load_metrics(run_dir / METRICS, metric)
    return run


def find_runs(path: Path) -> list[tuple[Path, str]]:
    """Every run under ``path``: the dir itself when it is a run dir, then the job subdirs of
    a sweep written into it (numeric names in numeric order). A sweep over a run's own dir
    (``make demo`` writes ``runs/sft``, then ``python -m tasks.sft -m ...`` writes
    ``runs/sft/0``, ``runs/sft/1``) reports the parent run and every job."""
    if not path.exists():
        raise ReportError(f"{path} does not exist")
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory")
    own = [(path, path.name)] if (path / METRICS).is_file() else []
    jobs = [sub for sub in path.iterdir() if sub.is_dir() and (sub / METRICS).is_file()]
    if not own and not jobs:
        raise ReportError(f"no {METRICS} found in {path} or its immediate subdirectories")
    jobs.sort(key=lambda sub: (0, int(sub.name), "") if sub.name.isdigit() else (1, 0, sub.name))
    return own + [(sub, f"{path.name}/{sub.name}") for sub in jobs]


def varying_keys(configs: list[dict[str, str] | None]) -> list[str]:
    """Config keys whose values differ between the runs that have a config (missing counts)."""
    known = [config for config in configs if config is not None]
    keys = sorted({key for config in known for key in config} - IGNORED_KEYS)
    return [key for key in keys if len({config.get(key) for config in known}) > 1]


def label_runs(runs: list[Run]) -> None:
    """Label each run by the keys its sweeps swept (else by its differing keys) with the
    values it used; fall back to (or add) the dir name."""
    sweeps = {run.path.parent for run in runs} | {run.path for run in runs}
    keys = list(dict.fromkeys(k for d in sorted(sweeps) for k in swept_keys(d)))
    keys = keys or varying_keys([run.config for run in runs])
    for run in runs:
        parts = [f"{k}={value}" for k in keys if (value := run.value(k)) is not None]
        run.label = " ".join(parts) or run.name
    labels = [run.label for run in runs]
    for run in runs:
        if labels.count(run.label) > 1 and run.label != run.name:
            run.label = f"{run.label} [{run.name}]"


def _is_num(value: Any) -> bool:
    """A plottable number (NaN/inf losses happen; they are shown in the table, not plotted)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite(values: list[tuple[int, Any]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in values if _is_num(v)]


def table_rows(runs: list[Run], metric: str = "loss") -> list[dict[str, Any]]:
    """One summary row per run, sorted by final metric (lowest first; non-finite last)."""
    rows = []
    for run in runs:
        recs = list(run.records.values())
        series = _finite([(step, rec[metric]) for step, rec in run.records.items()])
        best = min(series, key=lambda sv: sv[1]) if series else (None, None)
        speeds = [rec["tokens_per_s"] for rec in recs if "tokens_per_s" in rec]
        rows.append({
            "run": run.label, "steps": len(recs), "last_step": recs[-1]["step"],
            f"first_{metric}": recs[0][metric], f"final_{metric}": recs[-1][metric],
            f"min_{metric}": best[1], "min_step": best[0],
            # median: the first steps (warm-up, allocation) are far slower than the rest
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "final_lr": recs[-1].get("lr"),
        })  # fmt: skip
    final = f"final_{metric}"
    return sorted(rows, key=lambda r: (0, r[final]) if _is_num(r[final]) else (1, 0.0))


def _cell(value: Any, key: str) -> str:
    """Readable precision for the Markdown table (the CSV keeps full precision)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if key == "final_lr" else f"{value:.1f}" if key == "tokens_per_s" else f"{value:.4f}"  # fmt: skip
    return str(value).replace("|", "\\|")


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of ``table_rows``."""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(row[k], k) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """The table with full precision, for spreadsheets and pandas."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average fewer)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def loss_figure(runs: list[Run], metric: str = "loss", window: int = 1) -> Figure:
    """A line chart of ``metric`` vs step, one line per run, of exactly ``PNG_SIZE`` pixels."""
    from matplotlib.figure import Figure  # not pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(PNG_SIZE[0] / DPI, PNG_SIZE[1] / DPI), dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    for run in runs:
        points = _finite([(step, rec[metric]) for step, rec in run.records.items()])
        steps = [step for step, _ in points]
        axes.plot(steps, smooth([v for _, v in points], window), label=run.label, linewidth=1.5)
    title = f"{metric} vs step" + (f" (moving average over {window})" if window > 1 else "")
    axes.set(title=title, xlabel="step", ylabel=metric)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def write_png(runs: list[Run], path: Path, metric: str = "loss", window: int = 1) -> bool:
    """Write the chart as PNG; False (with a one-sentence note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: works without a display
    except ImportError:
        print(
            f"note: {path.name} not written because matplotlib is not installed "
            "(pip install 'veoptim[plots]').",
            file=sys.stderr,
        )
        return False
    loss_figure(runs, metric, window).savefig(path, dpi=DPI)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="run or sweep dir")
    parser.add_argument("--out", type=Path, help="output dir (default: the first PATH)")
    parser.add_argument("--metric", default="loss", help="metrics.jsonl key to tabulate and plot")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="plot moving average")
    args = parser.parse_args(argv)
    try:
        if args.smooth < 1:
            raise ReportError(f"--smooth must be at least 1, got {args.smooth}")
        runs = [load_run(d, args.metric, name) for p in args.paths for d, name in find_runs(p)]
        for run in [run for run in runs if not run.records]:
            print(f"warning: {run.path / METRICS} is empty; skipped", file=sys.stderr)
        runs = [run for run in runs if run.records]
        if not runs:
            raise ReportError("no run has any logged step")
        label_runs(runs)
        rows = table_rows(runs, args.metric)
        table = render_markdown(rows)
        out = args.out or args.paths[0]
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.md").write_text(table)
        write_csv(rows, out / "sweep.csv")
        png = out / f"{args.metric}.png"
        plotted = write_png(runs, png, args.metric, args.smooth)
    except (ReportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table, end="")
    written = [out / "sweep.md", out / "sweep.csv", *([png] if plotted else [])]
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
