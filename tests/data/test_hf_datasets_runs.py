"""End to end: an Alpaca parquet file and a ShareGPT JSON file each train a few steps
through ``python -m tasks.sft``, read with Hugging Face ``datasets``."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml

from tests.conftest import run_sft_cli
from tests.data.test_hf_datasets import ALPACA, SHAREGPT

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture
def run_args(tmp_path: Path, monkeypatch) -> list[str]:
    """A 3-step CPU run with its own datasets cache."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return [
        f"run.dir={tmp_path / 'run'}",
        "run.device=cpu",
        f"train.max_steps={STEPS}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "scheduler.warmup_steps=1",
        "logging.progress=false",
        "export.hf=false",
        "data.max_seq_len=128",
    ]


def assert_trained(proc, run_dir: Path, tmp_path: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["loss"] > 0 for r in records)
    assert list((tmp_path / "hf_cache" / "veoptim_sft").glob("sft-*.arrow"))  # tokenized once
    return yaml.safe_load((run_dir / "config.yaml").read_text())["data"]


def test_alpaca_parquet_trains(tmp_path, run_args):
    path = tmp_path / "alpaca.parquet"
    datasets.Dataset.from_list(ALPACA * 4).to_parquet(path)
    proc = run_sft_cli([*run_args, f"data.train_path={path}", "data.num_proc=2"], cwd=tmp_path)
    data = assert_trained(proc, tmp_path / "run", tmp_path)
    assert data["num_proc"] == 2 and data["layout"] == "auto"


def test_sharegpt_json_with_renamed_column_trains(tmp_path, run_args):
    path = tmp_path / "sharegpt.json"
    rows = [{"turns": row["conversations"]} for row in SHAREGPT * 4]
    path.write_text(json.dumps(rows))
    overrides = [
        f"data.train_path={path}",
        "data.layout=sharegpt",
        "data.columns.conversations=turns",
        "data.train_tool_turns=true",
    ]
    proc = run_sft_cli([*run_args, *overrides], cwd=tmp_path)
    data = assert_trained(proc, tmp_path / "run", tmp_path)
    assert data["columns"]["conversations"] == "turns" and data["train_tool_turns"] is True
