"""RL through the service visibly learns: on a base that answers the cookbook's arithmetic
problems right only sometimes (``tests/fixtures/arithmetic_base``, made by
``scripts/arithmetic_base.py``), the share of right answers and the mean reward rise over
a short run, for the cookbook's ``math_rl`` recipe (``importance_sampling``, unmodified,
through ``tests/service/math_rl_driver.py``) and for ``scripts/rl_sdk.py`` (the plain SDK
with the server's ``ppo`` loss), against one server at once, as two tenants; beside them
the negative control, the SDK run at learning rate 0, does not rise.

The rise of a run is the mean of its last :data:`K` steps minus the mean of its first
:data:`K` steps (``env/all/correct`` and ``env/all/reward/total`` of ``metrics.jsonl``).
The problems of each step are fixed (the recipe's dataset seeds each batch with its index;
the SDK script draws them from ``--seed`` and the step), and so is the SDK run's sampling;
the recipe's sampling is not seeded (the cookbook sends no seed), so its runs differ.

Measured on this 2-core CPU, 2026-12-05, SDK seeds 0-5 (the recipe's 6 runs are 6 unseeded
draws); the rise of ``env/all/correct`` (the reward's is the same: every answer was
well-formed, so the reward is the share of right answers):

=========  ==========================================  ======  =====
run        rise per run                                 min     first 10 steps' correct
=========  ==========================================  ======  =====
recipe     0.216 0.212 0.154 0.228 0.188 0.194         0.154   0.46-0.49
sdk_ppo    0.280 0.257 0.258 0.312 0.264 0.248         0.248   0.43-0.46
frozen     -0.013 0.020 -0.005 0.016 -0.013 0.033      |0.033| 0.33-0.36
=========  ==========================================  ======  =====

:data:`MARGIN`, 0.1, is two thirds of the least rise seen (the recipe's runs: mean 0.199,
standard deviation 0.026, so 0.1 is almost 4 deviations below it) and three times the
control's largest move. (The learning runs are right more often than the control already
in their first 10 steps: they learn from step 1.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import REPO
from tests.service.helpers import SubprocessServer, client_env
from veoptim.data import bundled_tokenizer_dir

pytest.importorskip("tinker_cookbook")
pytest.importorskip("math_verify")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

BASE = REPO / "tests" / "fixtures" / "arithmetic_base"
TOKENIZER = str(bundled_tokenizer_dir().resolve())
STEPS = 40
K = 10
LEARNING_RATE = 3e-3
GROUPS, GROUP_SIZE = 16, 8
MAX_TOKENS = 12  # the longest well-formed answer, " 1" "46" "\n" "\n" "U" "s" "er" ":", is 8
SDK_SEED = 0
#: The least rise of a learning run, and the most the control may move (module docstring).
MARGIN = 0.1
#: What "right only sometimes" means for the base: the first steps' share of right answers.
BASE_CORRECT = (0.1, 0.6)
RUN_TIMEOUT_S = 600
SERVER = [
    "model=hf_local",
    f"model.path={BASE}",
    f"serve.base_model={TOKENIZER}",
    "lora.num_slots=6",
]
REWARD, CORRECT = "env/all/reward/total", "env/all/correct"


def recipe_args(url: str, log_path: Path) -> list[str]:
    return [f"model_name={TOKENIZER}", "env=arithmetic", "renderer_name=role_colon",
            "loss_fn=importance_sampling", f"base_url={url}", f"log_path={log_path}",
            f"groups_per_batch={GROUPS}", f"group_size={GROUP_SIZE}", f"max_steps={STEPS}",
            f"max_tokens={MAX_TOKENS}", "lora_rank=8", f"learning_rate={LEARNING_RATE}",
            "save_every=0", "eval_every=0", "behavior_if_log_dir_exists=delete"]  # fmt: skip


def sdk_args(url: str, log_path: Path, learning_rate: float = LEARNING_RATE) -> list[str]:
    return ["--base-url", url, "--model", TOKENIZER, "--log-path", str(log_path), "--loss",
            "ppo", "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size",
            str(GROUP_SIZE), "--learning-rate", str(learning_rate), "--max-tokens",
            str(MAX_TOKENS), "--rank", "8", "--seed", str(SDK_SEED)]  # fmt: skip


def launches(url: str, root: Path) -> dict[str, tuple[str, list[str], str]]:
    """Each run: (driver module, its arguments, its tenant). ``sdk_frozen`` is the negative
    control: the SDK run at learning rate 0 (the same problems and seeds, a policy that
    never changes), whose rise is only the difference between early and late problems."""
    return {
        "recipe": ("tests.service.math_rl_driver", recipe_args(url, root / "recipe"), "alice"),
        "sdk_ppo": ("tests.service.rl_sdk_driver", sdk_args(url, root / "sdk_ppo"), "bob"),
        "sdk_frozen": (
            "tests.service.rl_sdk_driver",
            sdk_args(url, root / "sdk_frozen", 0.0),
            "bob",
        ),
    }


def steps_of(log_path: Path) -> list[dict]:
    """The run's steps in order (the rows of metrics.jsonl with a reward)."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return sorted((row for row in rows if REWARD in row), key=lambda row: row["step"])


def rise(rows: list[dict], key: str, k: int = K) -> float:
    values = [row[key] for row in rows]
    return sum(values[-k:]) / k - sum(values[:k]) / k


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[dict]]]:
    """Both runs, at once, against one server on the fixture base: each run's steps."""
    root = tmp_path_factory.mktemp("rl_learns")
    server = SubprocessServer(root / "serve", *SERVER)
    started = {}
    try:
        for name, (module, args, tenant) in launches(server.url, root).items():
            started[name] = forkserver.ForkedModule(
                module, args, cwd=root, env=client_env(server.keys[tenant]),
                stdout=root / f"{name}.out")  # fmt: skip
        for name, proc in started.items():
            code = proc.wait(timeout=RUN_TIMEOUT_S)
            output = (root / f"{name}.out").read_text()
            assert code == 0, f"{name} exited with {code}: {output[-3000:]}"
        yield {name: steps_of(root / name) for name in started}
    finally:
        for proc in started.values():
            proc.kill()
        server.kill()


@pytest.mark.parametrize("name", ["recipe", "sdk_ppo"])
def test_reward_and_right_answers_rise_over_the_run(runs, name):
    rows = runs[name]
    assert [row["step"] for row in rows] == list(range(STEPS)), name
    shown = " ".join(f"{row[CORRECT]:.2f}" for row in rows)
    first = sum(row[CORRECT] for row in rows[:K]) / K
    low, high = BASE_CORRECT
    assert low <= first <= high, f"{name}: the base is right {first:.2f} of the time: {shown}"
    for key in (CORRECT, REWARD):
        assert rise(rows, key) > MARGIN, (
            f"{name}: {key} rose {rise(rows, key):.3f} from the first {K} steps to the last "
            f"{K}, not more than {MARGIN}; correct per step: {shown}"
        )


def test_the_frozen_control_does_not_rise(runs):
    """The same measure on a policy that never learns stays under the margin: the rise of
    the learning runs is learning, not easier late problems."""
    rows = runs["sdk_frozen"]
    assert [row["step"] for row in rows] == list(range(STEPS))
    for key in (CORRECT, REWARD):
        assert abs(rise(rows, key)) < MARGIN, (
            f"sdk_frozen (learning rate 0): {key} moved {rise(rows, key):.3f} from the first "
            f"{K} steps to the last {K}; the learning runs must rise more than "
            f"{MARGIN}"
        )
