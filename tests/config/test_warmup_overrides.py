"""``scheduler.warmup_ratio`` given alone replaces the scheduler preset's ``warmup_steps``
(and ``warmup_steps`` given alone replaces a preset's ratio); both given stays an error."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from tasks.compose import CONFIG_DIR, load_config
from tests.conftest import run_sft_cli
from veoptim.errors import ConfigError

pytestmark = pytest.mark.slow

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "scheduler").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_ratio_alone_replaces_the_presets_steps(preset):
    config = load_config("sft", [f"scheduler={preset}", "scheduler.warmup_ratio=0.03"])
    assert (config.scheduler.warmup_ratio, config.scheduler.warmup_steps) == (0.03, 0)
    # the preset still sets its steps when nothing else is given
    assert load_config("sft", [f"scheduler={preset}"]).scheduler.warmup_steps == 10


def test_steps_alone_keep_no_ratio():
    config = load_config("sft", ["scheduler.warmup_steps=3"])
    assert (config.scheduler.warmup_ratio, config.scheduler.warmup_steps) == (0.0, 3)


def test_both_given_stay_an_error():
    both = ["scheduler.warmup_ratio=0.03", "scheduler.warmup_steps=5"]
    message = (
        "scheduler.warmup_ratio (0.03) and scheduler.warmup_steps (5) both set the warmup; give "
        "only one (either one alone on the command line replaces the other's preset value)."
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("sft", both)


def _run(tmp_path: Path, tiny_overrides: list[str], *args: str, flags: tuple = ()) -> dict:
    proc = run_sft_cli([*flags, *tiny_overrides, *args], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_dir = tmp_path / "run"
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "scheduler": yaml.safe_load((run_dir / "config.yaml").read_text())["scheduler"],
        "lr": lrs,
    }


def test_on_the_command_line_a_ratio_replaces_the_presets_steps(tmp_path, tiny_overrides):
    # tiny_overrides gives scheduler.warmup_steps=1; a ratio alone is what a user types
    overrides = [o for o in tiny_overrides if not o.startswith("scheduler.warmup_steps")]
    got = _run(
        tmp_path, overrides, "scheduler=constant", "scheduler.warmup_ratio=0.5", "optim.lr=1e-3"
    )
    assert got["scheduler"]["warmup_ratio"] == 0.5 and got["scheduler"]["warmup_steps"] == 0
    # 4 steps, warmup round(0.5 * 4) = 2: (s + 1) / 3 of the peak, then the peak
    assert got["lr"] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])


def test_on_the_command_line_steps_replace_a_presets_ratio(tmp_path, tiny_overrides):
    presets = tmp_path / "my_configs" / "scheduler"
    presets.mkdir(parents=True)
    (presets / "ratio.yaml").write_text("name: constant\nwarmup_steps: 0\nwarmup_ratio: 0.5\n")
    overrides = [o for o in tiny_overrides if not o.startswith("scheduler.warmup_steps")]
    config_dir = ("--config-dir", str(tmp_path / "my_configs"))
    got = _run(
        tmp_path,
        overrides,
        "scheduler=ratio",
        "scheduler.warmup_steps=1",
        "optim.lr=1e-3",
        flags=config_dir,
    )
    assert got["scheduler"]["warmup_ratio"] == 0.0 and got["scheduler"]["warmup_steps"] == 1
    assert got["lr"] == pytest.approx([1e-3 / 2, 1e-3, 1e-3, 1e-3])


def test_a_fractional_warmup_rounds_half_up_lr_by_lr(tmp_path, tiny_overrides):
    """warmup_ratio 0.1 of 15 steps is 1.5 warmup steps: 2 (the nearest step, a half up).
    The run's LRs, step by step: (s + 1) / 3 of the peak for s = 0, 1, then the cosine
    decay to min_lr_ratio 0.1 over the remaining 13 steps."""
    overrides = [o for o in tiny_overrides if not o.startswith(("scheduler.", "train.max_steps"))]
    got = _run(tmp_path, overrides, "train.max_steps=15", "scheduler=cosine",
               "scheduler.warmup_ratio=0.1", "optim.lr=1e-3")  # fmt: skip
    peak, floor, warmup = 1e-3, 0.1, 2

    def factor(s: int) -> float:  # the schedule as docs/optimizers.md states it
        if s < warmup:
            return (s + 1) / (warmup + 1)
        progress = (s - warmup + 1) / (15 - warmup)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    assert got["lr"] == [peak * factor(s) for s in range(15)]
    assert got["lr"][:3] == [peak / 3, peak * 2 / 3, got["lr"][2]] and got["lr"][2] < peak
    assert got["lr"][-1] == pytest.approx(floor * peak, rel=1e-12)
