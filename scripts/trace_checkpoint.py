"""Which library files a save, a resume, a slot save and a slot load pass through, and how
often they call across files.

A newcomer reading a save or a resume follows the calls file by file; this measures that
path on the bundled tiny model (one process, CPU): every Python call made while
``Trainer.save_checkpoint`` runs, then while a fresh trainer's ``Trainer.resume`` loads
that checkpoint, then while a ``SlotTrainer`` saves a slot (``save_slot``) and loads it
into another (``load_slot``), recorded with ``sys.setprofile``. Prints JSON: per
operation, the files of ``veoptim/`` entered (grouped as checkpoint files outside the DCP
storage, the distributed agreement they end their phases in, the DCP storage, and the
rest; ``checkpoint_file_count`` counts the first group), which files call into the storage
and which storage files they enter (its door: the ``storage`` package's own functions),
the number of distinct caller -> callee file edges between them, and how many times a
version was verified against its manifest (``versions.verify``).

    .venv/bin/python scripts/trace_checkpoint.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.compose import load_config  # noqa: E402
from veoptim.checkpoint import versions  # noqa: E402
from veoptim.distributed import init_distributed  # noqa: E402
from veoptim.slots import MultiLoRAConfig, SlotTrainer  # noqa: E402
from veoptim.trainer import Trainer  # noqa: E402

LIBRARY = REPO / "veoptim"
#: The checkpoint mechanism: what a save or resume is made of, beside the state it moves.
CHECKPOINT = "checkpoint/"
#: The cross-rank agreement every phase ends in (the distributed package's primitive).
AGREEMENT = "distributed/agreement.py"
#: DCP storage: raw format, writer, reader, prefault, read-ahead, durability.
STORAGE = "checkpoint/storage/"
OVERRIDES = [
    "run.device=cpu",
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "scheduler.warmup_steps=1",
    "logging.progress=false",
    "export.hf=false",
    "optim=full_fp32_adamw",
]


#: The function that checks a version against its manifest (one call per verification).
VERIFY = versions.verify.__code__


def trace(call: Callable[[], object]) -> tuple[set[str], set[tuple[str, str]], int]:
    """The library files entered during ``call()``, the cross-file call edges and the
    number of manifest verifications."""
    files: set[str] = set()
    edges: set[tuple[str, str]] = set()
    verifications = 0

    def library_file(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        try:
            return path.resolve().relative_to(LIBRARY).as_posix()
        except ValueError:
            return None

    def profile(frame, event, arg) -> None:
        nonlocal verifications
        if event != "call":
            return
        verifications += frame.f_code is VERIFY
        callee = library_file(frame)
        if callee is None:
            return
        files.add(callee)
        caller = frame.f_back
        while caller is not None and library_file(caller) is None:
            caller = caller.f_back  # through torch's frames to the library file that called
        if caller is not None and library_file(caller) != callee:
            edges.add((library_file(caller), callee))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return files, edges, verifications


def summary(files: set[str], edges: set[tuple[str, str]], verifications: int) -> dict:
    storage = sorted(f for f in files if f.startswith(STORAGE))
    checkpoint = sorted(f for f in files if f.startswith(CHECKPOINT) and f not in storage)
    mechanism = checkpoint + sorted(f for f in files if f == AGREEMENT)
    into_storage = {(a, b) for a, b in edges if b in storage and a not in storage}
    return {
        "checkpoint_files": checkpoint,
        "checkpoint_file_count": len(checkpoint),
        "manifest_verifications": verifications,
        "agreement_files": sorted(f for f in files if f == AGREEMENT),
        "storage_files": storage,
        "callers_into_storage": sorted({a for a, _ in into_storage}),
        "storage_entry_files": sorted({b for _, b in into_storage}),
        "other_library_files": len(files) - len(mechanism) - len(storage),
        "cross_file_edges_in_mechanism": sum(
            1 for a, b in edges if a in mechanism + storage and b in mechanism + storage
        ),
    }


def slot_trainer(run_dir: str) -> SlotTrainer:
    """A ``SlotTrainer`` of the bundled tiny model with two slots, on CPU."""
    cfg = MultiLoRAConfig()
    cfg.run.dir, cfg.run.device = run_dir, "cpu"
    cfg.lora.num_slots = 2
    return SlotTrainer.from_config(cfg)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("sft", [*OVERRIDES, f"run.dir={tmp}/run"])
        trainer = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))
        trainer.train_step()
        saved = summary(*trace(lambda: trainer.save_checkpoint()))
        resume_cfg = load_config(
            "sft", [*OVERRIDES, f"run.dir={tmp}/run", "checkpoint.resume=auto"]
        )
        fresh = Trainer.from_config(resume_cfg, init_distributed("cpu", "auto", {}))
        resumed = summary(*trace(fresh.resume))
        slots = slot_trainer(f"{tmp}/slots")
        slots.create_slot(0)
        slot_saved = summary(*trace(lambda: slots.save_slot(0, "traced")))
        slot_loaded = summary(*trace(lambda: slots.load_slot(1, "traced")))
        slots.close()
    print(
        json.dumps(
            {"save": saved, "resume": resumed, "slot_save": slot_saved, "slot_load": slot_loaded},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
