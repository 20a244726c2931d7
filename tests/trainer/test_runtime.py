"""The task-agnostic runtime: extra state components, a second objective, explicit resume.

Everything here goes through the real Trainer, Checkpointer, DCP and files: a task
that registers its own checkpointed state, an objective defined only in this test
module (plain next-token loss on every token), and callbacks that see the restored
state at ``on_train_begin``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from callbacks.checkpoint import CheckpointCallback
from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from veoptim.checkpoint import Publisher, resolve
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import ComponentState, SavedComponent, Staged, TensorSpec
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.config import TrainerConfig, validate_config
from veoptim.config.schema import DataConfig
from veoptim.data import bundled_dataset_path
from veoptim.distributed import init_distributed
from veoptim.errors import CheckpointError
from veoptim.trainer import Callback, LossSum, MicroBatch, Trainer


# ---------------------------------------------------------------- an extra component
class StepCounter:
    """Task state the standard components do not hold: a JSON count and a small tensor."""

    def __init__(self) -> None:
        self.count = 0
        self.history = torch.zeros(3)

    def state(self) -> ComponentState:
        return ComponentState(tensors={"history": self.history}, json={"count": self.count})

    def stage(self, saved: SavedComponent) -> Staged:
        if not isinstance(saved.json, dict) or not isinstance(saved.json.get("count"), int):
            raise CheckpointError(f"{saved.name} in {saved.path} has no integer count.")
        buffer = torch.empty_like(self.history)

        def install() -> None:
            self.count = saved.json["count"]
            self.history.copy_(buffer)

        return Staged(
            expected={"history": TensorSpec((3,), torch.float32)},
            buffers={"history": buffer},
            install=install,
        )


class CountSteps(Callback):
    def __init__(self, counter: StepCounter) -> None:
        self.counter = counter

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.counter.count += 1
        self.counter.history[trainer.progress.global_step % 3] += metrics["loss"]


def _with_counter(run_dir: Path) -> tuple[Trainer, StepCounter]:
    trainer = build_trainer(run_dir)
    counter = StepCounter()
    trainer.register_state("step_counter", counter)
    trainer.callbacks.callbacks.append(CountSteps(counter))
    return trainer, counter


def test_a_registered_component_is_saved_and_restored_bitwise(tmp_path):
    writer, counter = _with_counter(tmp_path / "w")
    writer.cfg.train.stop_at_step = 3
    writer.train()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "s3")
    info = json.loads((resolve(root, "s3") / C.INFO_FILE).read_text())
    assert list(info[C.INFO_COMPONENTS]) == [*writer.state]
    assert info[C.INFO_COMPONENTS]["step_counter"] == {"tensors": True, "json": "shared"}

    reader, restored = _with_counter(tmp_path / "r")
    load_with(Checkpointer(root, fsync=False), reader, "s3")
    assert restored.count == counter.count == 3
    assert torch.equal(restored.history, counter.history) and restored.history.abs().sum() > 0
    assert_bitwise_equal(snapshot(writer), snapshot(reader))


def _fails_closed(trainer: Trainer, root: Path, name: str, match: str) -> str:
    before = snapshot(trainer)
    counters = {k: (v.count, v.history.clone()) for k, v in trainer.state.items()
                if isinstance(v, StepCounter)}  # fmt: skip
    with pytest.raises(CheckpointError, match=match) as info:
        load_with(Checkpointer(root, fsync=False), trainer, name)
    assert_bitwise_equal(before, snapshot(trainer), "live state")
    for key, (count, history) in counters.items():
        assert trainer.state[key].count == count and torch.equal(
            trainer.state[key].history, history
        )
    return str(info.value)


def test_a_checkpoint_missing_a_live_component_or_holding_an_unknown_one_is_refused(tmp_path):
    plain = build_trainer(tmp_path / "plain")
    plain.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), plain, "without")
    with_counter, _ = _with_counter(tmp_path / "counted")
    with_counter.train_step()
    with_counter.state["step_counter"].count = 7
    message = _fails_closed(with_counter, root, "without", "has no state for step_counter")
    assert "state components" in message
    save_with(Checkpointer(root, fsync=False), with_counter, "with")
    other = build_trainer(tmp_path / "other")
    other.train_step()
    _fails_closed(other, root, "with", "holds state this run does not have: step_counter")
    # Weights only: the extra component is not needed and not read.
    load_with(Checkpointer(root, fsync=False), other, "with", load_optimizer=False)


def test_a_bad_extra_component_fails_before_any_live_state_changes(tmp_path):
    writer, _ = _with_counter(tmp_path / "w")
    writer.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "good")
    good = resolve(root, "good")
    # A validly published copy whose extra component's JSON is wrong (a buggy writer).
    with Publisher(root, fsync=False).write("bad") as out:
        for item in good.iterdir():
            if item.name != MANIFEST_FILE:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        C.shared_json_path(out, "step_counter").write_text(json.dumps({"count": "three"}))
    live, _ = _with_counter(tmp_path / "live")
    live.train_step()
    _fails_closed(live, root, "bad", "no integer count")


def test_component_names_are_identifiers(tmp_path):
    trainer = build_trainer(tmp_path)
    for bad in ("model", "Has.Dot", "../up", ""):
        with pytest.raises(CheckpointError):
            trainer.register_state(bad, StepCounter())


# ------------------------------------------------------------- a second objective
class EveryTokenObjective:
    """Plain next-token loss on every token of the bundled data's text (no masking)."""

    normaliser_name = "tokens"

    def __init__(self, tokenizer: Any, max_seq_len: int) -> None:
        lines = bundled_dataset_path().read_text().splitlines()[:64]
        texts = [" ".join(m["content"] for m in json.loads(line)["messages"]) for line in lines]
        self.rows = [
            torch.tensor(tokenizer(text)["input_ids"][:max_seq_len], dtype=torch.long)
            for text in texts
        ]
        self.pad_id = tokenizer.pad_token_id
        self.num_examples = len(self.rows)
        self.data_fingerprint = f"every-token:{sum(len(r) for r in self.rows)}"

    def setup(self, model: torch.nn.Module, starting_model: Any) -> None:
        pass

    def micro_batch(self, indices: list[int]) -> MicroBatch:
        rows = [self.rows[i] for i in indices]
        ids = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        mask = (ids != self.pad_id).long()
        return MicroBatch(
            inputs={"input_ids": ids, "attention_mask": mask},
            normaliser=int(mask[:, 1:].sum()),
            tokens=int(mask.sum()),
        )

    def loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> LossSum:
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        targets = inputs["input_ids"][:, 1:].masked_fill(inputs["attention_mask"][:, 1:] == 0, -100)
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                ignore_index=-100, reduction="sum")  # fmt: skip
        return LossSum(total, metrics={"seq_count": torch.tensor(float(len(targets)))})

    def state_components(self) -> dict:
        return {}


@dataclass
class EveryTokenConfig(TrainerConfig):
    data: DataConfig = field(default_factory=DataConfig)

    def build_objective(self, tokenizer: Any) -> EveryTokenObjective:
        return EveryTokenObjective(tokenizer, self.data.max_seq_len)


def _every_token_trainer(run_dir: Path, *, stop: int = 0, resume: str = "") -> Trainer:
    cfg = EveryTokenConfig()
    cfg.run.dir, cfg.run.device = str(run_dir), "cpu"
    cfg.train.max_steps, cfg.train.stop_at_step = 4, stop
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 2
    cfg.optim.name, cfg.model.dtype = "full_fp32_adamw", "bf16"
    cfg.logging.progress, cfg.export.hf = False, False
    cfg.checkpoint.fsync, cfg.checkpoint.resume = False, resume
    validate_config(cfg)
    ctx = init_distributed("cpu", "auto", {})
    return Trainer.from_config(cfg, ctx, [CheckpointCallback(cfg.checkpoint)])


class ExpectedNormaliser(Callback):
    """Recomputes each step's global normaliser from the sampler, independently of the loop."""

    def __init__(self) -> None:
        self.expected: list[float] = []
        self.logged: list[dict] = []

    def on_step_begin(self, trainer: Trainer) -> None:
        sampler = trainer.sampler
        indices = sampler.global_batch(sampler.epoch, sampler.step_in_epoch)
        self.expected.append(sum(len(trainer.objective.rows[i]) - 1 for i in indices))

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.logged.append(metrics)


def test_a_test_only_objective_trains_and_resumes_bitwise(tmp_path):
    straight = _every_token_trainer(tmp_path / "straight")
    check = ExpectedNormaliser()
    straight.callbacks.callbacks.append(check)
    straight.train()
    assert check.logged[-1]["loss"] < check.logged[0]["loss"]
    # Metric sums are divided by the global normaliser: 4 sequences / all target tokens.
    for metrics, normaliser in zip(check.logged, check.expected, strict=True):
        assert metrics["seq_count"] == pytest.approx(4 / normaliser)
    first = _every_token_trainer(tmp_path / "sliced", stop=2)
    first.train()
    resumed = _every_token_trainer(tmp_path / "sliced", resume="auto")
    resumed.train()
    assert resumed.resumed_from is not None and resumed.progress.global_step == 4
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))


# ------------------------------------------------------------------ explicit resume
class SeenAtBegin(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_begin(self, trainer: Trainer) -> None:
        self.seen = {
            "step": trainer.progress.global_step,
            "sampler": trainer.sampler.state_dict(),
            "optimizer": snapshot(trainer)["state"],
        }


def test_on_train_begin_sees_the_restored_state(tmp_path):
    writer = build_trainer(tmp_path / "w", ["train.stop_at_step=3"])
    writer.callbacks.callbacks.append(CheckpointCallback(writer.cfg.checkpoint))
    writer.train()  # saves step 3 at the end (a time slice always saves)
    expected = {
        "step": 3,
        "sampler": writer.sampler.state_dict(),
        "optimizer": snapshot(writer)["state"],
    }
    seen = SeenAtBegin()
    reader = build_trainer(tmp_path / "w", ["checkpoint.resume=auto"])
    reader.callbacks.callbacks.append(seen)
    reader.train()
    assert seen.seen["step"] == 3 and seen.seen["sampler"]["step_in_epoch"] == 3
    assert_bitwise_equal(expected, seen.seen)
