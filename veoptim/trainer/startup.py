"""What a run checks and builds before its model exists, shared by ``Trainer.from_config``
and the dry run (``run.dry_run=true``), so that a dry run refuses exactly what the real
run would refuse, with the same words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.arith import divisors
from veoptim.checkpoint import Checkpointer, StateComponent
from veoptim.config.launch import check_launch
from veoptim.config.schema import TrainerConfig
from veoptim.data import GlobalBatchSampler, load_tokenizer
from veoptim.data.holdout import Holdout, split_holdout
from veoptim.errors import CheckpointError, ConfigError, LiveStateInvalidError
from veoptim.models.build import check_model_fits
from veoptim.trainer.evaluation import EvalSet, build_eval_set
from veoptim.trainer.objective import Objective


@dataclass(frozen=True)
class RunInputs:
    """The tokenizer, the task's objective over its examples, and how they are split."""

    tokenizer: Any
    objective: Objective
    holdout: Holdout
    eval_set: EvalSet | None


def check_single_adapter(cfg: TrainerConfig, world_size: int) -> None:
    """A multi-rank config in one process, or multi-LoRA slots in this trainer: refused."""
    check_launch(cfg.parallel, world_size)
    if cfg.lora.num_slots:
        raise ConfigError(
            f"lora.num_slots={cfg.lora.num_slots} asks for multi-LoRA slots, which the "
            "multi-LoRA trainer runs (python -m tasks.multi_lora, "
            "veoptim.slots.SlotTrainer); this task trains one adapter with "
            "lora.enabled=true and lora.num_slots=0."
        )


def load_inputs(cfg: TrainerConfig) -> RunInputs:
    """Tokenizer (checked against the model's size and the sequence length), the task's
    objective, the eval hold-out and the eval set."""
    tokenizer = load_tokenizer(
        cfg.data.tokenizer_path, model_path=cfg.model.path, chat_template=cfg.data.chat_template
    )
    check_model_fits(cfg.model, len(tokenizer), cfg.data.max_seq_len, tokenizer.name_or_path)
    objective = cfg.build_objective(tokenizer)
    holdout = split_holdout(objective.num_examples, cfg.data.eval_fraction)
    return RunInputs(
        tokenizer, objective, holdout, build_eval_set(cfg, tokenizer, objective, holdout)
    )


def micro_batch_size(cfg: TrainerConfig, objective: Objective, dp_size: int) -> int:
    """``train.micro_batch_size``, or with ``train.micro_batch_tokens`` the largest divisor
    of the per-rank batch that many of the longest example fit in (at least 1): a fixed
    size, so the accumulation and the sums it makes do not change from step to step."""
    budget = cfg.train.micro_batch_tokens
    if not budget:
        return cfg.train.micro_batch_size
    longest = getattr(objective, "longest_example", None)
    if longest is None:
        raise ConfigError(
            f"train.micro_batch_tokens={budget}: this task's objective "
            f"({type(objective).__name__}) does not tell its longest example; set "
            "train.micro_batch_tokens=0 and train.micro_batch_size."
        )
    per_rank = cfg.train.global_batch_size // max(dp_size, 1)
    fits = [d for d in divisors(per_rank) if d * longest <= budget]
    return max(fits, default=1)


def build_sampler(
    cfg: TrainerConfig, inputs: RunInputs, *, dp_rank: int, dp_size: int
) -> GlobalBatchSampler:
    """The global-batch sampler over the training examples only (never the hold-out)."""
    holdout = inputs.holdout
    return GlobalBatchSampler(
        num_examples=len(holdout.train),
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=micro_batch_size(cfg, inputs.objective, dp_size),
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=cfg.train.seed,
        data_fingerprint=holdout.fingerprint(inputs.objective.data_fingerprint),
        indices=holdout.train if holdout.eval else None,
    )


def run_length(cfg: TrainerConfig, sampler: GlobalBatchSampler) -> int:
    """The run's optimizer steps (``train.max_steps`` or ``train.epochs`` passes), with
    ``train.stop_at_step`` checked against it."""
    max_steps = cfg.train.total_steps(sampler.steps_per_epoch)
    if cfg.train.stop_at_step > max_steps:
        raise ConfigError(
            f"train.stop_at_step ({cfg.train.stop_at_step}) must be <= the run's {max_steps} "
            f"steps (train.epochs={cfg.train.epochs} x {sampler.steps_per_epoch} steps per epoch)."
        )
    return max_steps


#: What continues the run dir's run from its newest checkpoint: its whole state, or its
#: weights alone (optimizer, LR schedule and data order start over).
RESUME_WHOLE = "checkpoint.resume=auto"
RESUME_WEIGHTS = "checkpoint.resume=auto checkpoint.load_optimizer=false"


def resume_option(
    checkpointer: Checkpointer,
    whole: Mapping[str, StateComponent],
    weights: Mapping[str, StateComponent],
    run: str | None,
) -> tuple[str | None, str]:
    """The overrides that would resume what ``checkpoint.resume=auto`` resolves to (the
    newest checkpoint of ``run``, the run dir's run) into this run: :data:`RESUME_WHOLE`,
    else :data:`RESUME_WEIGHTS`, else None; and why the whole state would be refused ('' when
    it would load; with None, why the weights would). Checked by the load's own validation
    of the live ``whole`` and ``weights`` components, so a hint built from it is not refused
    by the next start for anything that validation checks. Collective (agreed)."""
    resolved = checkpointer.resolve("auto", run=run)
    if resolved is None:  # auto finds none of the run's: it starts, nothing to refuse
        return RESUME_WHOLE, ""
    try:
        checkpointer.validate(whole, resolved.path, exact=True)
        return RESUME_WHOLE, ""
    except CheckpointError as error:
        why = _reason(error)
    try:
        checkpointer.validate(weights, resolved.path, exact=False)
    except CheckpointError as error:
        return None, _reason(error)
    return RESUME_WEIGHTS, why


def weights_hint_checked(
    error: CheckpointError,
    checkpointer: Checkpointer,
    weights: Mapping[str, StateComponent],
    ref: str,
    run: str | None,
) -> CheckpointError:
    """``error`` of a refused whole resume of ``ref`` (``auto``: of ``run``), whose hint to
    load the weights alone (``checkpoint.load_optimizer=false``) is checked by that load's
    validation: when it would be refused too, the error says so and why. Collective
    (agreed); an error with no such hint, or one raised after live state changed, is
    returned as it is."""
    if isinstance(error, LiveStateInvalidError) or "load_optimizer=false" not in str(error):
        return error
    resolved = checkpointer.resolve(ref, run=run)
    if resolved is None:
        return error
    try:
        checkpointer.validate(weights, resolved.path, exact=False)
    except CheckpointError as refused:
        return CheckpointError(
            f"{error} A weights-only load (checkpoint.load_optimizer=false) is refused as "
            f"well: {_reason(refused)}."
        )
    return error


def _reason(error: CheckpointError) -> str:
    """A refused validation's reason, without the agreement's frame ("validating checkpoint
    <path> failed on rank 0 of 1: CheckpointError: ") when one rank's reason is all."""
    text = str(error)
    frame = " failed on rank "  # one rank: its own reason follows the error type
    if frame in text and ": CheckpointError: " in text:
        text = text.split(": CheckpointError: ", 1)[1]
    return text.rstrip(".")


def used_root_error(
    root: Path, newest: str, resume: str | None = RESUME_WHOLE, why: str = ""
) -> ConfigError:
    """A fresh run (``checkpoint.resume`` empty) in a root that holds another run's
    checkpoints: their names would be re-pointed and retention could delete them. The
    way on it offers first is ``resume`` (see :func:`resume_option`; None: none)."""
    others = (
        "use another run.dir (or checkpoint.root), or pass checkpoint.overwrite=true to start "
        "over in it"
    )
    found = f"{root} already holds checkpoints (newest: {newest}) and checkpoint.resume is empty"
    if resume == RESUME_WHOLE:
        return ConfigError(f"{found}; continue that run with {resume}, {others}.")
    if resume is not None:
        return ConfigError(
            f"{found}; start from its weights with {resume} (its whole state does not fit "
            f"this run: {why}), {others}."
        )
    return ConfigError(f"{found}, and this run cannot resume from it ({why}); {others}.")
