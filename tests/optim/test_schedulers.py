"""LR schedules: shapes, restore into a fresh scheduler equals the continuous run bitwise."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from veoptim.config.schema import SchedulerConfig
from veoptim.errors import ConfigError
from veoptim.optim import SUPPORTED_SCHEDULERS, build_scheduler
from veoptim.optim.schedulers import ratio_steps, warmup_steps

MAX_STEPS = 50
PEAK = 3e-3


def _opt() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD(
        [{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1e-4}], lr=PEAK
    )


def _lrs(cfg: SchedulerConfig, steps: int = MAX_STEPS) -> list[float]:
    opt = _opt()
    sched = build_scheduler(opt, cfg, MAX_STEPS)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _cfg(name: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(name=name, **{"warmup_steps": 5, "min_lr_ratio": 0.1, **kw})


def test_warmup_rises_linearly_from_above_zero_to_peak():
    lrs = _lrs(_cfg("constant"))
    assert lrs[:6] == pytest.approx([PEAK * (s + 1) / 6 for s in range(5)] + [PEAK])
    assert lrs[0] > 0


def test_constant_stays_at_peak_after_warmup():
    assert set(_lrs(_cfg("constant"))[5:]) == {PEAK}


def test_linear_and_cosine_end_at_min_lr_ratio():
    for name in ("linear", "cosine"):
        lrs = _lrs(_cfg(name), MAX_STEPS + 3)
        assert 0.95 * PEAK < lrs[5] < PEAK
        assert lrs[MAX_STEPS - 1] == pytest.approx(0.1 * PEAK)
        assert lrs[-1] == pytest.approx(0.1 * PEAK)
        assert all(a >= b for a, b in zip(lrs[5:], lrs[6:], strict=False))


def test_cosine_midpoint_is_halfway():
    lrs = _lrs(_cfg("cosine", warmup_steps=0))
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert lrs[24] == pytest.approx(PEAK * mid)


def test_wsd_is_stable_then_decays_over_the_last_fraction():
    lrs = _lrs(_cfg("wsd", decay_ratio=0.2), MAX_STEPS + 1)
    assert set(lrs[5:40]) == {PEAK}
    assert lrs[40] < PEAK
    assert lrs[MAX_STEPS - 1] == pytest.approx(0.1 * PEAK)


@pytest.mark.parametrize("name", SUPPORTED_SCHEDULERS)
def test_restored_scheduler_reproduces_continuous_lr_bitwise(name):
    cfg = _cfg(name)
    opt = _opt()
    sched = build_scheduler(opt, cfg, MAX_STEPS)
    for _ in range(17):
        opt.step()
        sched.step()
    saved = copy.deepcopy(sched.state_dict())
    continuous = []
    for _ in range(10):
        opt.step()
        sched.step()
        continuous.append([g["lr"] for g in opt.param_groups])
    fresh_opt = _opt()  # optimizer state deliberately not restored: the scheduler sets the LR
    fresh = build_scheduler(fresh_opt, cfg, MAX_STEPS)
    fresh.load_state_dict(saved)
    resumed = []
    for _ in range(10):
        fresh_opt.step()
        fresh.step()
        resumed.append([g["lr"] for g in fresh_opt.param_groups])
    assert resumed == continuous


def test_restore_sets_the_current_lr_of_every_group():
    cfg = _cfg("cosine")
    opt = _opt()
    sched = build_scheduler(opt, cfg, MAX_STEPS)
    for _ in range(9):
        opt.step()
        sched.step()
    fresh_opt = _opt()
    build_scheduler(fresh_opt, cfg, MAX_STEPS).load_state_dict(sched.state_dict())
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]


def test_scheduler_state_dict_holds_only_plain_values():
    sched = build_scheduler(_opt(), _cfg("wsd"), MAX_STEPS)
    sd = sched.state_dict()
    assert set(sd) == {"last_epoch", "_step_count", "base_lrs", "_last_lr"}
    assert all(isinstance(v, (int, float, list)) for v in sd.values())


@pytest.mark.parametrize(
    "cfg, match",
    [
        (SchedulerConfig(name="poly"), "scheduler.name"),
        (SchedulerConfig(name="cosine", warmup_steps=-1), "warmup_steps"),
        (SchedulerConfig(name="wsd", warmup_steps=MAX_STEPS), "decay_ratio"),
        (SchedulerConfig(name="linear", min_lr_ratio=1.5), "min_lr_ratio"),
        (SchedulerConfig(name="wsd", warmup_steps=45, decay_ratio=0.2), "decay_ratio"),
    ],
)
def test_invalid_scheduler_config_is_rejected(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_scheduler(_opt(), cfg, MAX_STEPS)


def test_run_shorter_than_warmup_warms_up_throughout(caplog):
    """train.max_steps=5 with the default warmup works: the LR rises every step, with a warning."""
    cfg = _cfg("cosine", warmup_steps=10)
    opt = _opt()
    with caplog.at_level("WARNING"):
        sched = build_scheduler(opt, cfg, 5)
    assert "the whole run is warmup" in caplog.text
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([PEAK * (s + 1) / 11 for s in range(5)])


@pytest.mark.parametrize(
    ("ratio", "steps", "expected"),
    [(0.1, 15, 2), (0.1, 25, 3), (0.35, 90, 32), (0.07, 150, 11), (0.1, 14, 1), (0.03, 10, 0)],
)
def test_a_ratio_of_the_steps_rounds_to_the_nearest_step_half_up(ratio, steps, expected):
    """Halves go up whatever the float product's noise (0.35 x 90 was 31.499999999999996,
    0.07 x 150 10.500000000000002): the warmup and wsd's decay both count steps this way."""
    assert ratio_steps(ratio, steps) == expected
    cfg = SchedulerConfig(name="wsd", warmup_steps=0, warmup_ratio=ratio, decay_ratio=ratio)
    assert warmup_steps(cfg, steps) == expected
