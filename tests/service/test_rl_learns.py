"""RL through the service visibly learns: on a base that answers the cookbook's arithmetic
problems right only sometimes (``tests/fixtures/arithmetic_base``, made by
``scripts/arithmetic_base.py``), the share of right answers and the mean reward rise over
a short run, for the cookbook's ``math_rl`` recipe (``importance_sampling``, unmodified,
through ``tests/service/math_rl_driver.py``) and for ``scripts/rl_sdk.py`` (the plain SDK
with the server's ``ppo`` loss), both against one server at once, as two tenants.

The rise of a run is the mean of its last :data:`K` steps minus the mean of its first
:data:`K` steps (``env/all/correct`` and ``env/all/reward/total`` of ``metrics.jsonl``).
The problems of each step are fixed (the recipe's dataset seeds each batch with its index;
the SDK script draws them from ``--seed`` and the step), and so is the SDK run's sampling;
the recipe's sampling is not seeded (the cookbook sends no seed), so its runs differ.

MEASUREMENTS
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
#: The least rise of each run that passes (chosen from the runs in the module docstring).
MARGIN = {"recipe": 0.0, "sdk_ppo": 0.0}
#: What "right only sometimes" means for the base: the first steps' share of right answers.
BASE_CORRECT = (0.1, 0.6)
RUN_TIMEOUT_S = 600
SERVER = ["model=hf_local", f"model.path={BASE}", f"serve.base_model={TOKENIZER}", "lora.num_slots=6"]
REWARD, CORRECT = "env/all/reward/total", "env/all/correct"


def recipe_args(url: str, log_path: Path) -> list[str]:
    return [f"model_name={TOKENIZER}", "env=arithmetic", "renderer_name=role_colon",
            "loss_fn=importance_sampling", f"base_url={url}", f"log_path={log_path}",
            f"groups_per_batch={GROUPS}", f"group_size={GROUP_SIZE}", f"max_steps={STEPS}",
            f"max_tokens={MAX_TOKENS}", "lora_rank=8", f"learning_rate={LEARNING_RATE}",
            "save_every=0", "eval_every=0", "behavior_if_log_dir_exists=delete"]  # fmt: skip


def sdk_args(url: str, log_path: Path) -> list[str]:
    return ["--base-url", url, "--model", TOKENIZER, "--log-path", str(log_path), "--loss",
            "ppo", "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size",
            str(GROUP_SIZE), "--learning-rate", str(LEARNING_RATE), "--max-tokens",
            str(MAX_TOKENS), "--rank", "8", "--seed", str(SDK_SEED)]  # fmt: skip


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
    logs = {"recipe": root / "recipe", "sdk_ppo": root / "sdk_ppo"}
    started = {}
    try:
        started["recipe"] = forkserver.ForkedModule(
            "tests.service.math_rl_driver", recipe_args(server.url, logs["recipe"]), cwd=root,
            env=client_env(server.keys["alice"]), stdout=root / "recipe.out")  # fmt: skip
        started["sdk_ppo"] = forkserver.ForkedModule(
            "tests.service.rl_sdk_driver", sdk_args(server.url, logs["sdk_ppo"]), cwd=root,
            env=client_env(server.keys["bob"]), stdout=root / "sdk_ppo.out")  # fmt: skip
        for name, proc in started.items():
            code = proc.wait(timeout=RUN_TIMEOUT_S)
            output = (root / f"{name}.out").read_text()
            assert code == 0, f"{name} exited with {code}: {output[-3000:]}"
        yield {name: steps_of(log) for name, log in logs.items()}
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
        assert rise(rows, key) > MARGIN[name], (
            f"{name}: {key} rose {rise(rows, key):.3f} from the first {K} steps to the last "
            f"{K}, not more than {MARGIN[name]}; correct per step: {shown}"
        )
