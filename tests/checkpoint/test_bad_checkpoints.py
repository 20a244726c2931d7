"""Bad checkpoints fail closed: one clear CheckpointError, the live run bitwise unchanged.

Each bad checkpoint is a real, validly *published* version (its manifest matches
its files) whose content is wrong — what a buggy writer, another run or an attacker
could leave behind — so the loader's own checks, not the manifest, must catch it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.checkpoint.helpers.pickles import dangerous_payloads
from veoptim.checkpoint import Publisher, resolve, step_name
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.checkpoint.storage.safe_dcp import ALLOWED_GLOBALS, read_dcp_metadata
from veoptim.errors import CheckpointError
from veoptim.state import MODEL, OPTIMIZER, SAMPLER
from veoptim.trainer import Trainer

GOOD = step_name(3)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class Saved(NamedTuple):
    """A good checkpoint at step 3, the trainer that wrote it (for its tensors) and that
    trainer's whole state at save time (RNG states are process-wide: capture them then)."""

    root: Path
    writer: Trainer
    at_save: dict[str, Any]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    run_dir = tmp_path_factory.mktemp("saved")
    trainer = build_trainer(run_dir)
    for _ in range(3):
        trainer.train_step()
    save_with(Checkpointer(run_dir / "ckpt", fsync=False), trainer, GOOD)
    return Saved(run_dir / "ckpt", trainer, snapshot(trainer))


@pytest.fixture
def live(tmp_path) -> Trainer:
    """The run a bad checkpoint is loaded into: one real step, so every state exists."""
    trainer = build_trainer(tmp_path / "live")
    trainer.train_step()
    return trainer


def republish(
    root: Path,
    name: str,
    tensors: dict | None = None,
    edit: Callable[[Path], None] | None = None,
) -> None:
    """Copy the good version's files under a new name, optionally rewrite DCP / edit files."""
    source = resolve(root, GOOD)
    with Publisher(root, fsync=False).write(name) as out:
        for item in source.iterdir():
            if item.name == MANIFEST_FILE or (tensors is not None and item.name == C.DCP_DIR):
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        if tensors is not None:
            dcp.save(tensors, checkpoint_id=out / C.DCP_DIR)
        if edit is not None:
            edit(out)


def tensors_of(trainer: Trainer) -> dict:
    """The writer's tensors in fresh containers (DCP hands out the optimizer's own dicts)."""
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer)["state"]
    return {
        MODEL: dict(get_model_state_dict(trainer.model)),
        OPTIMIZER: {fqn: dict(entry) for fqn, entry in state.items()},
    }


def assert_fails_closed(live: Trainer, root: Path, name: str, match: str, **kwargs) -> str:
    before = snapshot(live)
    with pytest.raises(CheckpointError, match=match) as info:
        load_with(Checkpointer(root, fsync=False), live, name, **kwargs)
    assert_bitwise_equal(before, snapshot(live), "live state")
    return str(info.value)


def perturb_rngs() -> None:
    """Move every global RNG away from any seeded state."""
    random.seed(987_654)
    np.random.seed(987_654)
    torch.manual_seed(987_654)


def test_good_checkpoint_loads_into_a_fresh_run(saved, live):
    """Every piece of restored state equals the writer's at save time: params, optimizer
    state and param groups, scheduler, sampler, progress and (perturbed first) the RNGs."""
    perturb_rngs()
    before = snapshot(live)
    assert before.keys() == saved.at_save.keys()
    for key in before:  # every component really has something to restore
        with pytest.raises(AssertionError):
            assert_bitwise_equal(saved.at_save[key], before[key], key)
    load_with(Checkpointer(saved.root), live, GOOD)
    assert live.progress.global_step == 3
    assert_bitwise_equal(saved.at_save, snapshot(live), "restored")


def test_missing_tensor(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    del tensors[MODEL]["lm_head.weight"]
    republish(root, "missing_tensor", tensors)
    message = assert_fails_closed(live, root, "missing_tensor", "missing 1 tensor")
    assert "model.lm_head.weight" in message


def test_missing_optimizer_state_key(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    del tensors[OPTIMIZER]["model.norm.weight"]["exp_avg_sq"]
    republish(root, "missing_moment", tensors)
    assert_fails_closed(live, root, "missing_moment", r"optimizer\.model\.norm\.weight\.exp_avg_sq")


def test_extra_tensor(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    tensors[MODEL]["surprise.weight"] = torch.zeros(3)
    republish(root, "extra_tensor", tensors)
    assert_fails_closed(live, root, "extra_tensor", r"unexpected 1 tensor.*model\.surprise\.weight")


def test_wrong_shape(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    tensors[MODEL]["model.norm.weight"] = torch.ones(65, dtype=torch.bfloat16)
    republish(root, "wrong_shape", tensors)
    assert_fails_closed(
        live,
        root,
        "wrong_shape",
        r"model\.norm\.weight \(expected \[64\] bfloat16, found \[65\] bfloat16\)",
    )


def test_transposed_optimizer_state_is_rejected(saved, live):
    """Same element count, other shape: a moment of a 2-D weight stored transposed."""
    tensors = tensors_of(saved.writer)
    fqn = "model.layers.0.mlp.gate_proj.weight"
    moment = tensors[OPTIMIZER][fqn]["exp_avg"]
    assert moment.dim() == 2 and moment.shape[0] != moment.shape[1]
    tensors[OPTIMIZER][fqn]["exp_avg"] = moment.t().contiguous()
    republish(saved.root, "transposed_moment", tensors)
    rows, cols = moment.shape
    assert_fails_closed(
        live,
        saved.root,
        "transposed_moment",
        rf"optimizer\.{re.escape(fqn)}\.exp_avg \(expected \[{rows}, {cols}\] float32, "
        rf"found \[{cols}, {rows}\] float32\)",
    )


def test_bf16_rounded_masters_are_rejected_not_cast(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    for entry in tensors[OPTIMIZER].values():
        entry["master_weight"] = entry["master_weight"].to(torch.bfloat16)
    republish(root, "bf16_masters", tensors)
    assert_fails_closed(
        live, root, "bf16_masters", r"master_weight \(expected .* float32, found .* bfloat16\)"
    )


def _truncate_first(pattern: str) -> Callable[[Path], None]:
    def truncate(out: Path) -> None:
        shard = next((out / C.DCP_DIR).glob(pattern))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    return truncate


def test_truncated_raw_data_file_is_refused_before_reading(saved, live):
    """The default (raw) layout's index says how long every data file must be."""
    republish(saved.root, "truncated_raw", edit=_truncate_first("*.raw"))
    assert_fails_closed(live, saved.root, "truncated_raw", r"validating .* is truncated")


def test_truncated_dcp_shard_fails_in_the_read_phase(saved, live):
    """DCP's own torch_save layout (checkpoint.format=dcp) is caught when it is read."""
    tensors = tensors_of(saved.writer)
    republish(saved.root, "truncated_dcp", tensors, edit=_truncate_first("*.distcp"))
    assert_fails_closed(live, saved.root, "truncated_dcp", "reading checkpoint")


def _data_files(out: Path) -> list[Path]:
    return sorted((out / C.DCP_DIR).glob("*.raw"))


def test_missing_raw_data_file_is_refused_before_reading(saved, live):
    republish(saved.root, "missing_raw", edit=lambda out: _data_files(out)[-1].unlink())
    assert_fails_closed(live, saved.root, "missing_raw", r"validating .* is missing")


def test_extra_data_file_is_refused_before_reading(saved, live):
    def add(out: Path) -> None:
        (out / C.DCP_DIR / "__0_9.raw").write_bytes(bytes(64))

    republish(saved.root, "extra_raw", edit=add)
    assert_fails_closed(live, saved.root, "extra_raw", r"does not list: \['__0_9.raw'\]")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": "float16"}, "does not match its tensor's dtype"),
        ({"shape": (1,)}, "does not match its tensor's dtype"),
        ({"offset": 1 << 40}, "is truncated"),
        ({"relative_path": "../../escape.raw"}, "malformed raw index entry"),
        ({"length": 3}, "wrong byte length"),
    ],
)
def test_corrupted_raw_index_is_refused_before_reading(saved, live, change, match):
    """Every entry of the index (in DCP's metadata) is checked against the tensor's
    metadata and the data files before a byte is read."""

    def corrupt(out: Path) -> None:
        path = out / C.DCP_DIR / ".metadata"
        metadata = read_dcp_metadata(out / C.DCP_DIR)
        key = max(metadata.storage_data, key=lambda k: metadata.storage_data[k].length)
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **change)
        path.write_bytes(pickle.dumps(metadata))

    name = f"bad_index_{next(iter(change))}"
    republish(saved.root, name, edit=corrupt)
    assert_fails_closed(live, saved.root, name, match)


def test_corrupted_metadata(saved, live):
    root = saved.root
    republish(
        root,
        "bad_metadata",
        edit=lambda out: (out / C.DCP_DIR / ".metadata").write_bytes(b"\x80\x04garbage"),
    )
    assert_fails_closed(live, root, "bad_metadata", "metadata .* unreadable")


def test_published_version_without_manifest_is_incomplete(saved, live):
    root = saved.root
    republish(root, "no_manifest")
    (resolve(root, "no_manifest") / MANIFEST_FILE).unlink()
    assert_fails_closed(live, root, "no_manifest", "manifest")


def test_unknown_format_version(saved, live):
    root = saved.root

    def bump(out: Path) -> None:
        info = json.loads((out / C.INFO_FILE).read_text())
        info[C.INFO_FORMAT_VERSION] = 99
        (out / C.INFO_FILE).write_text(json.dumps(info))

    republish(root, "future_format", edit=bump)
    assert_fails_closed(live, root, "future_format", "format_version 99")


def test_not_a_training_checkpoint(saved, live):
    root = saved.root
    republish(root, "no_info", edit=lambda out: (out / C.INFO_FILE).unlink())
    assert_fails_closed(live, root, "no_info", "checkpoint.json is missing")


def test_other_expert_parallel_layout_rejects_optimizer_state(saved, live):
    root = saved.root

    def other_layout(out: Path) -> None:
        info = json.loads((out / C.INFO_FILE).read_text())
        info[C.INFO_LAYOUT].update(ep_size=2, num_experts=4, expert_placement=[[0, 1], [2, 3]])
        (out / C.INFO_FILE).write_text(json.dumps(info))

    republish(root, "other_ep", edit=other_layout)
    message = assert_fails_closed(live, root, "other_ep", "cannot be loaded into this run")
    assert "load_optimizer=false" in message


def test_pickle_payload_in_metadata_is_never_executed(saved, live, tmp_path):
    root = saved.root
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    republish(
        root,
        "pickle_payload",
        edit=lambda out: (out / C.DCP_DIR / ".metadata").write_bytes(pickle.dumps(Payload())),
    )
    assert_fails_closed(live, root, "pickle_payload", "refusing to unpickle")
    assert not marker.exists()


def test_dangerous_names_of_allowed_modules_are_refused(saved, live, tmp_path):
    """The allow-list holds (module, name) pairs: another name of an allowed module
    (``builtins.eval``, ``torch.save``, the metadata module's ``os``, ...) is refused,
    never called, and the live run is unchanged."""
    marker = tmp_path / "pwned"
    allowed_modules = {module for module, _ in ALLOWED_GLOBALS}
    for index, ((module, name), payload) in enumerate(dangerous_payloads(marker).items()):
        assert module in allowed_modules and (module, name) not in ALLOWED_GLOBALS

        def plant(out: Path, payload: bytes = payload) -> None:
            (out / C.DCP_DIR / ".metadata").write_bytes(payload)

        republish(saved.root, f"payload_{index}", edit=plant)
        message = assert_fails_closed(live, saved.root, f"payload_{index}", "refusing to unpickle")
        assert f"references {module}.{name}," in message, message
        assert not marker.exists(), f"{module}.{name} ran: {marker} was created"


def test_non_tensor_entry_in_dcp_is_refused(saved, live):
    root, writer = saved.root, saved.writer
    tensors = tensors_of(writer)
    tensors[MODEL]["config_blob"] = {"an": "object"}
    republish(root, "bytes_entry", tensors)
    assert_fails_closed(live, root, "bytes_entry", "non-tensor entry")


def test_malformed_sampler_state(saved, live):
    root = saved.root

    def break_sampler(out: Path) -> None:
        C.shared_json_path(out, SAMPLER).write_text(json.dumps({"epoch": "soon"}))

    republish(root, "bad_sampler", edit=break_sampler)
    assert_fails_closed(live, root, "bad_sampler", "validating checkpoint")


def test_config_that_changes_the_run_is_reported(saved, tmp_path):
    root = saved.root
    other = build_trainer(tmp_path / "other", ["train.max_steps=7"])
    other.train_step()
    message = assert_fails_closed(other, root, GOOD, "different config")
    assert "train.max_steps: saved 6, live 7" in message
    # Weights only: the schedule may change, only the model must match.
    load_with(Checkpointer(root), other, GOOD, load_optimizer=False)
    assert other.progress.global_step == 1  # progress is not restored on a weights-only load


def test_edited_training_data_is_reported(tmp_path):
    """Same data path and example count, one response edited: the sampler position would
    pick other examples, so a full resume fails closed; the unedited file resumes."""
    from veoptim.data.paths import bundled_dataset_path

    data = tmp_path / "train.jsonl"
    lines = bundled_dataset_path().read_text().splitlines()
    data.write_text("\n".join(lines) + "\n")
    writer = build_trainer(tmp_path / "writer", [f"data.train_path={data}"])
    writer.train_step()
    root = tmp_path / "writer" / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "step_1")
    first = json.loads(lines[0])
    first["messages"][-1]["content"] += " (edited)"
    data.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    edited = build_trainer(tmp_path / "edited", [f"data.train_path={data}"])
    edited.train_step()
    message = assert_fails_closed(edited, root, "step_1", "training data differs")
    assert "checkpoint.load_optimizer=false" in message
    data.write_text("\n".join(lines) + "\n")
    restored = build_trainer(tmp_path / "restored", [f"data.train_path={data}"])
    load_with(Checkpointer(root, fsync=False), restored, "step_1")
    assert restored.progress.global_step == 1


def test_unknown_name_and_escaping_reference(saved, live, tmp_path, monkeypatch):
    root = saved.root
    assert_fails_closed(live, root, "no_such_checkpoint", "no_such_checkpoint")
    # Not a name, so a path: an explicit user path is allowed, but this is no checkpoint.
    not_a_checkpoint = tmp_path / "just_a_dir"
    not_a_checkpoint.mkdir()
    assert_fails_closed(live, root, str(not_a_checkpoint), "checkpoint.json is missing")
    # A relative path is tried from the working directory, then from the checkpoint root;
    # one that exists in neither is reported, whatever the machine's directory tree holds.
    monkeypatch.chdir(tmp_path)
    assert_fails_closed(live, root, "../../veoptim_no_such_dir", "does not exist")


def test_load_into_a_fresh_run_skips_dcps_placeholder_step(saved, tmp_path):
    """No zero grads, no placeholder masters/moments: resume memory stays at training level."""
    root, writer = saved.root, saved.writer
    fresh = build_trainer(tmp_path / "fresh")
    assert not fresh.optimizer.state
    steps: list[int] = []
    fresh.optimizer.register_step_pre_hook(lambda *args: steps.append(1))
    load_with(Checkpointer(root), fresh, GOOD)
    assert steps == [], "DCP's zero-LR init step ran and allocated placeholder state"
    assert_bitwise_equal(snapshot(writer)["state"], snapshot(fresh)["state"])


def test_a_format_1_checkpoint_is_refused_naming_both_versions(live, tmp_path):
    """A real checkpoint written by the previous format (committed fixture, tiny model)."""
    root = tmp_path / "v1"
    shutil.copytree(FIXTURES / "checkpoint_format_v1", root, symlinks=True)
    for load_optimizer in (True, False):
        message = assert_fails_closed(
            live, root, "step_00000002", "format_version 1", load_optimizer=load_optimizer
        )
        assert "reads format_version 2" in message


def test_raw_data_file_one_byte_short_is_refused_before_reading(saved, live):
    """A shard cut inside its last tensor (the last byte gone, as a copy interrupted at
    the very end leaves it), not merely halved: refused in validation, naming the file,
    its size and the size its index needs."""
    good = sorted((resolve(saved.root, GOOD) / C.DCP_DIR).glob("*.raw"))
    assert good
    for shard in good:
        size = shard.stat().st_size
        name = f"short_{shard.stem.strip('_')}"

        def cut(out: Path, shard: Path = shard) -> None:
            path = out / C.DCP_DIR / shard.name
            path.write_bytes(path.read_bytes()[:-1])

        republish(saved.root, name, edit=cut)
        message = assert_fails_closed(live, saved.root, name, r"validating")
        expected = f"{shard.name} is truncated: {size - 1} bytes, its index needs {size}."
        assert expected in message, message
