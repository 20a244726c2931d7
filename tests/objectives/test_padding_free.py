"""``data.padding_free``: a micro-batch is one row of its examples side by side, so no
padding is computed, and training matches padded batches.

Tolerance: with ``model.attn_implementation=sdpa_varlen`` (and with ``sdpa``, which masks
the row block-diagonally), FP32 losses and gradient norms of 4 steps within 1e-6 relative
of padded batches (measured 8e-8: the same sums over other matrix shapes). Resume is
bitwise within the mode.
"""

from __future__ import annotations

import pytest

from tasks.compose import compose_config, load_config
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS, LABELS, POSITION_IDS
from veoptim.distributed import init_distributed
from veoptim.objectives.sft import ROW_MULTIPLE, count_loss_tokens
from veoptim.trainer import Trainer

BASE = ["run.device=cpu", "logging.progress=false", "logging.level=WARNING", "export.hf=false",
        "checkpoint.fsync=false", "train.global_batch_size=8", "train.micro_batch_size=4",
        "optim.fused=false"]  # fmt: skip
PADDING_FREE = ["data.padding_free=true", "model.attn_implementation=sdpa_varlen"]
RTOL = 1e-6


def trainer(tmp_path, overrides: list[str]) -> Trainer:
    cfg = load_config("sft", [f"run.dir={tmp_path}", *BASE, *overrides])
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def curve(tmp_path, overrides: list[str], steps: int = 4) -> list[tuple[float, float]]:
    t = trainer(tmp_path, ["train.max_steps=10", *overrides])
    t.model.train()
    return [(m["loss"], m["grad_norm"]) for m in (t.train_step() for _ in range(steps))]


def test_a_micro_batch_is_one_row_padded_only_at_its_end(tmp_path):
    padded = trainer(tmp_path / "a", []).objective
    free = trainer(tmp_path / "b", ["data.padding_free=true"]).objective
    indices = [3, 17, 42, 99]
    a, b = padded.micro_batch(indices), free.micro_batch(indices)
    lengths = [len(padded.dataset[i][INPUT_IDS]) for i in indices]
    row = -(-sum(lengths) // ROW_MULTIPLE) * ROW_MULTIPLE  # a few pad tokens bound the shapes
    assert b.inputs[INPUT_IDS].shape == (1, row) and ATTENTION_MASK not in b.inputs
    pad = row - sum(lengths)
    assert b.inputs[POSITION_IDS][0].tolist() == [p for n in [*lengths, pad] for p in range(n)]
    assert (b.inputs[LABELS][0, sum(lengths) :] == -100).all()
    assert (b.normaliser, b.tokens) == (a.normaliser, a.tokens) == (
        count_loss_tokens(a.inputs[LABELS]), sum(lengths))  # fmt: skip
    assert a.inputs[INPUT_IDS].numel() > sum(lengths)  # the padded batch pads every example


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa"])
def test_padding_free_trains_like_padded_batches(tmp_path, attn):
    padded = curve(tmp_path / "padded", [])
    free = curve(tmp_path / "free", ["data.padding_free=true", f"model.attn_implementation={attn}"])
    for (loss, norm), (loss_f, norm_f) in zip(padded, free, strict=True):
        assert abs(loss_f - loss) <= RTOL * loss and abs(norm_f - norm) <= RTOL * norm


def test_documents_seeing_each_other_would_be_caught(tmp_path):
    """Negative control: the same row with positions that never restart (one long
    document, causal attention across examples) trains measurably differently."""
    padded = curve(tmp_path / "padded", [], steps=1)
    t = trainer(tmp_path / "leaky", ["train.max_steps=10", *PADDING_FREE])
    make = t.objective.micro_batch

    def leaky(indices):
        batch = make(indices)
        batch.inputs[POSITION_IDS] = batch.inputs[POSITION_IDS].new_tensor(
            range(batch.inputs[INPUT_IDS].shape[1])
        )[None]
        return batch

    t.objective.micro_batch = leaky
    t.model.train()
    loss = t.train_step()["loss"]
    assert abs(loss - padded[0][0]) > 1e3 * RTOL * padded[0][0]


def test_resume_is_bitwise_with_padding_free(tmp_path):
    common = [*BASE, *PADDING_FREE, "model.dtype=bf16", "optim=master_fp32_adamw",
              "train.max_steps=4"]  # fmt: skip
    straight, sliced = ckpt_io.straight_and_sliced(tmp_path, common, stop=2)
    a = ckpt_io.read_checkpoint(straight / "checkpoints" / step_name(4))
    b = ckpt_io.read_checkpoint(sliced / "checkpoints" / step_name(4))
    assert ckpt_io.differences(a, b) == []
    assert ckpt_io.metrics(straight) == ckpt_io.metrics(sliced)
    assert compose_config("sft", PADDING_FREE).data.padding_free
