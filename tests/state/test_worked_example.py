"""docs/architecture.md's worked example of a new state component, run as the page shows it.

The code block under "Adding checkpointed state" is executed as a module; a task built
on its config then trains, is stopped, resumed through the real checkpoint callback and
``resume=auto``, and must count on from the checkpoint's count to the uninterrupted run's
count with bitwise-equal state. Its checkpoints and plain SFT ones refuse each other,
and a bad saved count is refused before anything live changes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from callbacks.checkpoint import CheckpointCallback
from tasks.compose import compose_config
from tests.checkpoint.ckpt_state import TINY, assert_bitwise_equal, load_with, save_with, snapshot
from veoptim.checkpoint import Publisher, resolve
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.config import to_config, validate_config
from veoptim.distributed import init_distributed
from veoptim.errors import CheckpointError
from veoptim.trainer import Trainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SECTION = "## Adding checkpointed state"


@pytest.fixture(scope="module")
def example() -> types.ModuleType:
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.find("\n## ", len(SECTION))]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block under {SECTION!r}, found {len(blocks)}"
    module = types.ModuleType("counted_sft_doc_example")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(blocks[0], f"{DOC}:{SECTION}", "exec"), module.__dict__)
        yield module
    finally:
        del sys.modules[module.__name__]


def _trainer(run_dir: Path, config_class: type, *, stop: int = 0, resume: str = "") -> Trainer:
    base = to_config(compose_config("sft", [*TINY, f"run.dir={run_dir}"]))
    cfg = config_class(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    cfg.train.stop_at_step = stop
    cfg.checkpoint.fsync, cfg.checkpoint.resume = False, resume
    validate_config(cfg)
    return Trainer.from_config(
        cfg, init_distributed("cpu", "auto", {}), [CheckpointCallback(cfg.checkpoint)]
    )


def _counted(example: Any, run_dir: Path, **kwargs: Any) -> Trainer:
    return _trainer(run_dir, example.CountedSFTConfig, **kwargs)


def test_the_count_is_saved_and_a_resumed_run_counts_on_bitwise(example, tmp_path):
    straight = _counted(example, tmp_path / "straight")
    straight.train()
    total = straight.objective.read.tokens
    assert total > 0 and straight.progress.global_step == 6

    first = _counted(example, tmp_path / "sliced", stop=3)
    first.train()
    halfway = first.objective.read.tokens
    assert 0 < halfway < total
    resumed = _counted(example, tmp_path / "sliced", resume="auto")
    assert resumed.objective.read.tokens == 0  # nothing restored before the run starts
    resumed.train()
    assert resumed.resumed_from is not None and resumed.progress.global_step == 6
    assert resumed.objective.read.tokens == total
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))


def _fails_closed(trainer: Trainer, root: Path, ref: str, match: str) -> None:
    before = snapshot(trainer)
    count = getattr(trainer.objective, "read", None)
    count = count.tokens if count else None
    with pytest.raises(CheckpointError, match=match):
        load_with(Checkpointer(root, fsync=False), trainer, ref)
    assert_bitwise_equal(before, snapshot(trainer), "live state")
    if count is not None:
        assert trainer.objective.read.tokens == count


def test_plain_and_counted_checkpoints_refuse_each_other_and_a_bad_count_is_refused(
    example, tmp_path
):
    from veoptim.objectives.schema import SFTConfig

    root = tmp_path / "ckpt"
    counted = _counted(example, tmp_path / "counted")
    counted.train_step()
    save_with(Checkpointer(root, fsync=False), counted, "counted")
    plain = _trainer(tmp_path / "plain", SFTConfig)
    plain.train_step()
    save_with(Checkpointer(root, fsync=False), plain, "plain")

    saved = json.loads(C.shared_json_path(resolve(root, "counted"), "tokens_read").read_text())
    assert saved == {"tokens": counted.objective.read.tokens} and saved["tokens"] > 0

    _fails_closed(plain, root, "counted", "holds state this run does not have: tokens_read")
    _fails_closed(counted, root, "plain", "has no state for tokens_read")
    load_with(Checkpointer(root, fsync=False), plain, "counted", load_optimizer=False)

    # A validly published copy whose count is not an integer (a buggy writer).
    good = resolve(root, "counted")
    with Publisher(root, fsync=False).write("bad") as out:
        for item in good.iterdir():
            if item.name != MANIFEST_FILE:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        C.shared_json_path(out, "tokens_read").write_text(json.dumps({"tokens": "three"}))
    other = _counted(example, tmp_path / "other")
    other.train_step()
    _fails_closed(other, root, "bad", "expected an integer 'tokens'")
