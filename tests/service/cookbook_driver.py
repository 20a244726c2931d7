"""``tinker_cookbook.supervised.train`` on the conversations file its wheel bundles, against
a server: ``python -m tests.service.cookbook_driver URL TOKENIZER_DIR LOG_PATH MAX_STEPS``
(the key in ``TINKER_API_KEY``). The cookbook's pricing download is switched off: the
test machine has no network and the run must not try."""

from __future__ import annotations

import asyncio
import importlib.resources
import sys

import tinker_cookbook.utils.cost_estimation as cost_estimation
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from tests.service.helpers import run_and_exit


def main(url: str, tokenizer: str, log_path: str, max_steps: int) -> None:
    cost_estimation._pricing_fetched = True  # no pricing download
    data = importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=tokenizer, renderer_name="role_colon", max_length=128,
        batch_size=4,
    )  # fmt: skip
    config = train.Config(
        log_path=log_path, model_name=tokenizer, recipe_name="veoptim_service_test",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common),
        learning_rate=5e-3, lora_rank=8, base_url=url, save_every=2, eval_every=0,
        infrequent_eval_every=0, max_steps=max_steps,
    )  # fmt: skip
    asyncio.run(train.main(config))


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
