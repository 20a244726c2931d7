"""Bad slot checkpoints and references fail closed: one SlotError for the slot named, the
live slot and every other slot bitwise unchanged, and the other slots keep training.

Each bad checkpoint is a validly *published* save (its manifest matches its files), so
the loader's own checks must catch it, not the manifest."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.slots.helpers import all_states, assert_unchanged, build, train
from veoptim.checkpoint import component as C
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.versions import resolve
from veoptim.errors import ConfigError, SlotError

GOOD = "save_000001"
LORA_A = "model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    """A trainer whose slot 0 is saved as 'alice' (good) after two steps."""
    trainer = build(tmp_path_factory.mktemp("writer"))
    trainer.create_slot(0)
    train(trainer, 2, [0])
    trainer.save_slot(0, "alice")
    trainer.save_slot(0, "sampler", with_optimizer=False)
    return trainer


@pytest.fixture
def live(tmp_path, writer):
    """Slots 0-2 trained, sharing the writer's checkpoint root."""
    trainer = build(tmp_path, **{"checkpoint.root": str(writer.store.root.parent)})
    for slot in range(3):
        trainer.create_slot(slot)
    train(trainer, 1, [0, 1, 2])
    return trainer


def tensors_of(version: Path) -> dict[str, torch.Tensor]:
    metadata = read_dcp_metadata(version / C.DCP_DIR)
    out = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
    }
    dcp.load(out, storage_reader=SafeFileSystemReader(version / C.DCP_DIR), no_dist=True)
    return out


def republish(
    store_root: Path,
    name: str,
    *,
    source: str = "alice",
    tensors: Callable[[dict], dict] | None = None,
    edit: Callable[[Path], None] | None = None,
) -> str:
    """Publish a copy of ``source``'s good save as ``<name>/save_000001`` with its DCP
    tensors rewritten and/or its files edited; returns the reference to load."""
    good = resolve(store_root / source, GOOD)
    with Publisher(store_root / name, fsync=False).write(GOOD, step=1) as out:
        for item in good.iterdir():
            if item.name == MANIFEST_FILE or (tensors is not None and item.name == C.DCP_DIR):
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        if tensors is not None:
            dcp.save(tensors(tensors_of(good)), checkpoint_id=out / C.DCP_DIR, no_dist=True)
        if edit is not None:
            edit(out)
    return name


def edit_json(relative: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(out: Path) -> None:
        path = out / relative
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


def assert_fails_closed(live, ref, match: str, slot: int = 1, **kwargs) -> str:
    before = all_states(live)
    with pytest.raises(SlotError, match=match) as info:
        live.load_slot(slot, ref, **kwargs)
    assert info.value.slot == slot
    assert_unchanged(before, live)
    train(live, 1, [0, 1, 2], start=700)  # every slot still trains
    return str(info.value)


def without(key: str) -> Callable[[dict], dict]:
    return lambda t: {k: v for k, v in t.items() if k != key}


def test_the_good_checkpoint_loads(writer, live):
    live.load_slot(1, "alice")


def test_missing_optimizer_state(writer, live):
    ref = republish(writer.store.root, "no_moment", tensors=without(f"optimizer.{LORA_A}.exp_avg"))
    assert_fails_closed(live, ref, rf"missing 1 tensor.*optimizer\.{LORA_A}\.exp_avg")


def _shards(out: Path) -> list[Path]:
    """The DCP data files (``.raw`` or ``.distcp``, after ``checkpoint.format``)."""
    return sorted(p for p in (out / C.DCP_DIR).iterdir() if p.name != ".metadata")


def test_missing_shard_file(writer, live):
    def drop_shard(out: Path) -> None:
        shards = _shards(out)
        assert len(shards) > 1
        shards[-1].unlink()

    ref = republish(writer.store.root, "no_shard", edit=drop_shard)
    assert_fails_closed(live, ref, "is missing|reading checkpoint")


def test_truncated_shard(writer, live):
    def truncate(out: Path) -> None:
        shard = max(_shards(out), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    ref = republish(writer.store.root, "truncated", edit=truncate)
    assert_fails_closed(live, ref, "is truncated|reading checkpoint")


def test_other_world_size(writer, live):
    ref = republish(
        writer.store.root, "two_ranks",
        edit=edit_json(C.INFO_FILE, lambda info: info.update({C.INFO_WORLD_SIZE: 2})),
    )  # fmt: skip
    assert_fails_closed(live, ref, "saved on 2 ranks.*same topology.*load_optimizer=False")
    live.load_slot(1, ref, load_optimizer=False)  # weights load across topologies


def test_other_rank_layout(writer, live):
    def other_layout(info: dict) -> None:
        info[C.INFO_LAYOUT]["mesh_dim_sizes"] = [2, 1, 1]

    ref = republish(writer.store.root, "replicated", edit=edit_json(C.INFO_FILE, other_layout))
    assert_fails_closed(live, ref, r"layout dp_replicate=2 x efsdp=1 x ep=1; .*same topology")


def test_wrong_shape(writer, live):
    def transpose(tensors: dict) -> dict:
        key = f"optimizer.{LORA_A}.exp_avg"
        tensors[key] = tensors[key].t().contiguous()
        return tensors

    ref = republish(writer.store.root, "transposed", tensors=transpose)
    assert_fails_closed(live, ref, rf"optimizer\.{LORA_A}\.exp_avg \(expected \[8, 64\]")


def test_other_maximum_rank(writer, live, tmp_path):
    small = build(
        tmp_path / "small", **{"lora.r": 4, "checkpoint.root": str(writer.store.root.parent)}
    )
    small.create_slot(0)
    small.save_slot(0, "rank4")
    assert_fails_closed(live, "rank4", "maximum rank 4.*maximum rank 8")


def test_wrong_dtype(writer, live):
    def bf16_masters(tensors: dict) -> dict:
        return {
            k: v.to(torch.bfloat16) if k.endswith(".master_weight") else v
            for k, v in tensors.items()
        }

    ref = republish(writer.store.root, "bf16_masters", tensors=bf16_masters)
    assert_fails_closed(live, ref, r"master_weight \(expected \[.*\] float32, found .* bfloat16\)")


def test_weights_of_another_dtype(writer, live, tmp_path):
    fp32 = build(
        tmp_path / "fp32",
        **{"model.dtype": "fp32", "checkpoint.root": str(writer.store.root.parent)},
    )
    fp32.create_slot(0)
    fp32.save_slot(0, "fp32")
    assert_fails_closed(live, "fp32", "float32", load_optimizer=False)


def test_other_base(writer, live, tmp_path):
    other = build(
        tmp_path / "other",
        **{"model.init_seed": 99, "checkpoint.root": str(writer.store.root.parent)},
    )
    other.create_slot(0)
    other.save_slot(0, "other_base")
    assert_fails_closed(live, "other_base", "another base model.*init_seed")


def test_sampler_checkpoint_with_optimizer(writer, live):
    assert_fails_closed(live, "sampler", "sampler checkpoint")


def test_escaping_references(writer, live, tmp_path):
    root = writer.store.root
    for ref, match in [
        ("../alice", "name '..' is not allowed"),
        ("alice/../../x", "must be '<name>', '<name>/<save>' or a path inside"),
        ("/etc", "outside the slot checkpoint root"),
        ("a/b/c", "must be '<name>', '<name>/<save>' or a path inside"),
        (".versions", "name '.versions' is not allowed"),
    ]:
        assert_fails_closed(live, ref, match)
    outside = tmp_path / "elsewhere" / "copy"
    shutil.copytree(resolve(root / "alice", GOOD), outside)
    assert_fails_closed(live, str(outside), "outside the slot checkpoint root")
    os.symlink(outside, root / "alice" / "sneaky")
    assert_fails_closed(live, "alice/sneaky", "links escaping the root are refused")
    assert_fails_closed(live, str(root / "alice" / "sneaky"), "links escaping the root are refused")


def test_escaping_save_names(live):
    before = all_states(live)
    for name in ("../evil", "a/b", "/abs", ".hidden", ""):
        with pytest.raises(SlotError, match="slot 0: saving it as"):
            live.save_slot(0, name)
    assert_unchanged(before, live)
    assert not (live.store.root.parent / "evil").exists()


@pytest.mark.parametrize(
    "key, value",
    [("train.epochs", 2), ("train.eval_every", 5), ("data.eval_path", "x.jsonl"),
     ("data.eval_fraction", 0.1)],
)  # fmt: skip
def test_keys_a_slot_trainer_cannot_honour_are_refused(tmp_path, key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build(tmp_path, **{key: value})


def test_the_slot_schedule_defaults_like_the_trainer(tmp_path):
    from veoptim.config.schema import DEFAULT_MAX_STEPS

    trainer = build(tmp_path, **{"train.max_steps": 0, "scheduler.name": "linear"})
    trainer.create_slot(0)
    assert trainer.slots[0].optimizer.scheduler.max_steps == DEFAULT_MAX_STEPS


@pytest.mark.parametrize("rank", [0, 9])
def test_a_saved_adapter_rank_outside_1_to_lora_r_is_refused(writer, live, rank):
    """The right maximum rank (8) but a slot rank of 0 or above lora.r: refused naming the
    range, the rank found and the checkpoint, before any slot changes. The edited adapter
    JSON is published with a matching manifest (as a foreign writer would), so the
    loader's rank check refuses it, not the manifest's checksum."""

    def set_rank(adapter: dict) -> None:
        assert adapter["max_rank"] == 8 and adapter["spec"]["r"] == 8
        adapter["spec"]["r"] = rank

    ref = republish(
        writer.store.root, f"rank{rank}", edit=edit_json(f"{C.STATE_DIR}/adapter.json", set_rank)
    )
    message = assert_fails_closed(
        live, ref, rf"has rank {rank} and alpha 16\.0; expected a rank in \[1, 8\]"
    )
    assert "adapter of slot checkpoint" in message and f"rank{rank}" in message
    assert "checksum" not in message
