"""DPO's logged metrics against direct computations on the model the step started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.compose import compose_config, load_config
from tasks.runner import run_task
from veoptim.distributed import init_distributed
from veoptim.trainer import Trainer

#: Short chosen answers, long rejected ones: their sequence log-probs differ by far more
#: than any tolerance, so a metric reporting the other side is visible.
PAIRS = [
    {"prompt": 'Uppercase "bee"', "chosen": "BEE", "rejected": "bee bee bee, and a bee again"},
    {"prompt": 'Repeat "seal"', "chosen": "seal", "rejected": "fish and a seal and a lemon"},
    {"prompt": "What is 48+44?", "chosen": "92", "rejected": "It is ninety, or maybe 90 or 91"},
    {"prompt": 'Repeat "deer bat"', "chosen": "deer bat", "rejected": "apple bat, deer, fox, eel"},
]
#: One step over all four pairs in two micro-batches (rows of a micro-batch are padded).
RUN = ["run.device=cpu", "logging.progress=false", "logging.level=WARNING",
       "logging.log_every=1", "checkpoint.fsync=false", "model=tiny_dense", "model.path=",
       "export.hf=false", "train.global_batch_size=4", "train.micro_batch_size=2",
       "train.max_steps=1", "scheduler.warmup_steps=1"]  # fmt: skip


def _side_logp(model: torch.nn.Module, example: dict[str, torch.Tensor]) -> float:
    """Summed log-probability of the labelled tokens of one unpadded sequence, each token
    predicted from the position before it."""
    ids, labels = example["input_ids"], example["labels"]
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    log_probs = torch.log_softmax(logits, dim=-1)
    return sum(
        float(log_probs[t - 1, labels[t]]) for t in range(1, len(ids)) if int(labels[t]) != -100
    )


def test_logged_logps_are_the_mean_sequence_logps_of_each_side(tmp_path: Path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    overrides = [*RUN, f"data.train_path={data}"]
    # The starting policy, built like the run builds it (same config, same init seed).
    start = Trainer.from_config(
        load_config("dpo", [f"run.dir={tmp_path / 'start'}", *overrides]),
        init_distributed("cpu", "gloo", {}),
        [],
    )
    dataset = start.objective.dataset
    assert len(dataset) == len(PAIRS)
    start.model.eval()
    expected = {
        side: sum(_side_logp(start.model, dataset[i][side]) for i in range(len(PAIRS))) / len(PAIRS)
        for side in ("chosen", "rejected")
    }
    assert abs(expected["chosen"] - expected["rejected"]) > 5.0  # a swap is visible
    run_dir = tmp_path / "run"
    run_task(compose_config("dpo", [f"run.dir={run_dir}", *overrides]), env={})
    (first,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert first["step"] == 1
    assert first["logps/chosen"] == pytest.approx(expected["chosen"], rel=1e-5)
    assert first["logps/rejected"] == pytest.approx(expected["rejected"], rel=1e-5)
    # Policy == reference at step 1: zero rewards, whatever the log-probs.
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/rejected"] == pytest.approx(0.0, abs=1e-6)
