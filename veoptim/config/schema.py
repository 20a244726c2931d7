"""Structured run configuration: one dataclass per config group.

Every field has a type, a default and a help text (``metadata["help"]``); the
config reference in ``docs/config.md`` is generated from these dataclasses and
a test keeps the two in sync. Hydra validates overrides against these types, so
unknown keys and wrong types fail at startup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veoptim.errors import ConfigError


def opt(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    """A dataclass field with a default and a help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    dir: str = opt(
        "runs/sft", "Run directory: resolved config, metrics.jsonl, checkpoints, exports."
    )
    name: str = opt("sft", "Human-readable run name (used by wandb and the progress bar).")
    device: str = opt(
        "auto", "Compute device: auto | cpu | cuda | npu (auto = cuda if available, else cpu)."
    )
    dry_run: bool = opt(
        False,
        "Check the run without training: validate the config, resolve the data and model "
        "paths, build the tokenizer and the dataset index, print the plan (model, parameters, "
        "steps, batch sizes, world size, checkpoint and run dirs) and exit; writes no checkpoint.",
    )


@dataclass
class ModelConfig:
    name: str = opt("tiny_dense", "Label of the model preset (informational).")
    path: str = opt(
        "",
        "Hugging Face model to load instead of building from config: a local model directory, "
        "or a Hub id (org/name) taken from the local Hub cache or downloaded into it "
        "(required with model=hf_local; its tokenizer is used unless data.tokenizer_path is set).",
    )
    revision: str = opt(
        "",
        "Hub models (model.path=org/name): the branch, tag or commit to load (empty = main); "
        "the resolved config pins the commit it resolved to.",
    )
    hub_id: str = opt(
        "",
        "Set by veoptim when model.path names a Hub model: the id (model.path then holds its "
        "snapshot directory in the Hub cache, model.revision the commit).",
    )
    arch: str = opt("qwen2", "Architecture built from config: qwen2 | qwen2_moe | qwen3_moe.")
    hidden_size: int = opt(64, "Hidden size of the built model.")
    intermediate_size: int = opt(128, "MLP intermediate size (dense layers).")
    num_hidden_layers: int = opt(2, "Number of decoder layers.")
    num_attention_heads: int = opt(4, "Attention heads.")
    num_key_value_heads: int = opt(2, "Key/value heads (grouped-query attention).")
    max_position_embeddings: int = opt(
        512, "Longest position the built model supports (model.path: its config.json's)."
    )
    num_experts: int = opt(0, "Experts per MoE layer (MoE architectures only).")
    num_experts_per_tok: int = opt(2, "Experts each token is routed to (MoE only).")
    moe_intermediate_size: int = opt(64, "Intermediate size of each expert (MoE only).")
    dtype: str = opt(
        "fp32",
        "Parameter dtype of the trained model: fp32 | bf16 | fp16 (fp16: an exact optimizer's "
        "FP32 masters and dynamic loss scaling, train.loss_scale_*; with "
        "parallel.param_dtype=fp16).",
    )
    quant: str = opt(
        "none",
        "Frozen base storage of a LoRA run: none | nf4 (QLoRA: the decoder's Linear weights in "
        "4-bit NF4 via bitsandbytes, quantized at load; adapters, masters and moments stay "
        "full precision; needs lora.enabled=true and the quant extra).",
    )
    tie_word_embeddings: bool = opt(False, "Share input embedding and LM head weights.")
    init_seed: int = opt(1234, "Seed of the weight initialisation (independent of train.seed).")
    attention_dropout: float = opt(
        0.0,
        "Attention dropout probability of a model built from config (model.path keeps its own).",
    )
    attn_implementation: str = opt(
        "sdpa",
        "Attention kernel, for a model built from config and for model.path alike: sdpa "
        "(torch's scaled_dot_product_attention) | eager | flash_attention_2 (CUDA with the "
        "flash_attn package only) | sdpa_varlen (sdpa over each document of a packed or "
        "data.padding_free row alone, not over the whole row; padded batches as sdpa).",
    )
    activation_checkpointing: bool = opt(
        False,
        "Recompute each decoder layer's activations in the backward instead of keeping them: "
        "less activation memory for longer sequences, about one more forward of compute; "
        "gradients and state-dict keys are unchanged.",
    )
    compile: bool = opt(
        False,
        "Compile each decoder layer with torch.compile (inductor, dynamic shapes): the "
        "element-wise work fused; the first steps compile (tens of seconds on a CPU); "
        "numerics within rounding of eager (resume stays bitwise within the mode).",
    )


@dataclass
class DataConfig:
    """What every task's data has; a task's own data section extends it."""

    tokenizer_path: str = opt(
        "",
        "Tokenizer directory (AutoTokenizer); empty = model.path's tokenizer, or the bundled "
        "one for a model built from config.",
    )
    chat_template: str = opt(
        "",
        "Chat template instead of the tokenizer's own: chatml | qwen2 | llama3 (its end-of-turn "
        "token becomes the EOS and must be a token of the tokenizer), or a Jinja file path; "
        "exports save it with the tokenizer (empty = the tokenizer's own).",
    )
    max_seq_len: int = opt(
        96,
        "Sequences are truncated (or packed) to this many tokens (<= the model's "
        "max_position_embeddings); the truncated share is logged at startup.",
    )
    eval_path: str = opt(
        "",
        "Evaluation file, read exactly like data.train_path (empty = none; not with "
        "data.eval_fraction).",
    )
    eval_fraction: float = opt(
        0.0,
        "Share of the training examples held out for evaluation and never trained on, in "
        "[0, 1): a fixed split that depends only on the number of examples, not on "
        "train.seed (0 = none; not with data.eval_path).",
    )


#: Optimizer steps of a run that sets neither train.max_steps nor train.epochs.
DEFAULT_MAX_STEPS = 1000


@dataclass
class TrainConfig:
    max_steps: int = opt(
        0,
        "Optimizer steps of the whole run (the LR schedule targets this); 0 = set by "
        f"train.epochs, or {DEFAULT_MAX_STEPS} when train.epochs is 0 too.",
    )
    epochs: int = opt(
        0,
        "Passes over the training data instead of train.max_steps (0 = unset; setting both "
        "is an error): steps = epochs * (training examples // global_batch_size).",
    )
    eval_every: int = opt(
        0,
        "Evaluate every N optimizer steps (0 = only at the end of training; evaluation "
        "needs data.eval_path or data.eval_fraction and always runs at the end).",
    )
    stop_at_step: int = opt(0, "Save and exit cleanly at this global step (0 = run to max_steps).")
    global_batch_size: int = opt(16, "Sequences per optimizer step, summed over all ranks.")
    micro_batch_size: int = opt(4, "Sequences per forward/backward on one rank.")
    micro_batch_tokens: int = opt(
        0,
        "Choose the micro-batch from a token budget instead of train.micro_batch_size (0 = "
        "off): the largest divisor of the per-rank batch whose worst case, that many copies "
        "of the longest training example, fits in this many tokens (SFT).",
    )
    grad_clip: float = opt(1.0, "Max global gradient norm (0 = no clipping).")
    seed: int = opt(0, "Seed of data order and RNG states.")
    loss_scale_init: float = opt(
        65536.0,
        "model.dtype=fp16: the first loss scale (a power of two >= 1); it halves on every "
        "step whose gradients overflow (the step is skipped) and doubles after "
        "train.loss_scale_growth_interval clean steps.",
    )
    loss_scale_growth_interval: int = opt(
        2000, "model.dtype=fp16: clean steps in a row after which the loss scale doubles."
    )

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run, once the training data's size is known."""
        if self.epochs:
            return self.epochs * steps_per_epoch
        return self.max_steps or DEFAULT_MAX_STEPS


@dataclass
class ParamGroupConfig:
    pattern: str = opt("", "Regex (re.search on full parameter names) selecting this group.")
    lr: float = opt(-1.0, "Learning rate of the group (-1 = optim.lr).")
    weight_decay: float = opt(-1.0, "Weight decay of the group (-1 = optim.weight_decay).")


@dataclass
class OptimConfig:
    name: str = opt("adamw", "adamw | full_fp32_adamw | master_fp32_adamw | cpu_offload_adamw.")
    lr: float = opt(3e-3, "Peak learning rate.")
    betas: list[float] = opt([0.9, 0.999], "Adam betas (beta1, beta2).")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(0.0, "Decoupled weight decay (AdamW).")
    no_decay_patterns: list[str] = opt(
        ["bias$", "norm"], "Regexes of parameters that get no weight decay (norms, biases)."
    )
    param_groups: list[ParamGroupConfig] = opt([], "Extra param groups by regex, first match wins.")
    fused: bool = opt(True, "adamw only: use torch's fused kernel where the device supports it.")
    stochastic_rounding: bool = opt(
        False, "Write BF16 params from FP32 masters with stochastic rounding."
    )
    sr_seed: int = opt(0, "Seed of the stochastic-rounding noise (reproducible across resumes).")
    moment_dtype: str = opt("fp32", "Moment dtype of the device-resident exact types: fp32 | bf16.")
    cpu_offload_param_patterns: list[str] = opt(
        [], "cpu_offload_adamw: regexes of parameters whose master and moments live in host memory."
    )
    cpu_moment_dtype: str = opt("fp32", "cpu_offload_adamw: moment dtype of offloaded groups.")
    resident_moment_dtype: str = opt("fp32", "cpu_offload_adamw: moment dtype of resident groups.")
    chunk_size: int = opt(1 << 20, "cpu_offload_adamw: elements per staging chunk.")


@dataclass
class SchedulerConfig:
    name: str = opt("cosine", "constant | linear | cosine | wsd (warmup-stable-decay).")
    warmup_steps: int = opt(
        10,
        "Linear warmup steps up to the peak LR (>= max_steps: the whole run warms up); given "
        "on the command line, it replaces a preset's warmup_ratio.",
    )
    warmup_ratio: float = opt(
        0.0,
        "Warmup as a fraction of the run's steps, in [0, 1), instead of warmup_steps "
        "(0 = use warmup_steps), rounded to the nearest step, a half up (0.1 x 15 -> 2); "
        "given on the command line, it replaces the preset's warmup_steps (both given: an "
        "error).",
    )
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of the peak (linear, cosine, wsd).")
    decay_ratio: float = opt(0.2, "wsd: fraction of max_steps spent in the final decay.")


@dataclass
class LoRAConfig:
    enabled: bool = opt(False, "Train low-rank adapters on a frozen base instead of all weights.")
    r: int = opt(8, "Adapter rank.")
    alpha: float = opt(16.0, "Scaling numerator: the update is scaled by alpha / r.")
    dropout: float = opt(0.0, "Dropout on the adapter's input (the base path has none).")
    use_rslora: bool = opt(False, "Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r.")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Linear layers to adapt, by name: a module matches when its name is one of these or "
        "ends with '.<name>'.",
    )
    target_regex: str = opt(
        "", "Instead of target_modules: a regex that must fullmatch a Linear's full name."
    )
    target_experts: list[str] = opt(
        [],
        "MoE models: fused expert weights to adapt per expert (gate_up_proj, down_proj); "
        "needs lora.dropout=0.",
    )
    num_slots: int = opt(
        0,
        "Multi-LoRA (tasks.multi_lora, SlotTrainer): adapters per targeted layer, one per "
        "slot; lora.r is then each slot's maximum rank (0 = a single adapter).",
    )
    allow_other_base: bool = opt(
        False,
        "Resume adapters on a base whose content differs from the one they were trained on "
        "(refused by default: the log names both bases).",
    )


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(1, "Replicated data-parallel degree (HSDP outer dim).")
    dp_shard: int = opt(-1, "FSDP2 sharding degree; -1 fills the rest of the world size.")
    ep: int = opt(1, "Expert-parallel degree (MoE); experts are split across ep ranks.")
    param_dtype: str = opt(
        "bf16", "FSDP2 MixedPrecisionPolicy compute dtype: bf16 | fp32 | fp16 (model.dtype=fp16)."
    )
    reduce_dtype: str = opt("fp32", "FSDP2 gradient reduce dtype: fp32 | bf16.")
    backend: str = opt("auto", "Process-group backend: auto | gloo | nccl | hccl.")


@dataclass
class CheckpointConfig:
    root: str = opt("", "Checkpoint root; empty = <run.dir>/checkpoints.")
    save_steps: int = opt(0, "Save every N optimizer steps (0 = off).")
    save_epochs: int = opt(0, "Save every N epochs (0 = off).")
    save_at_end: bool = opt(True, "Save when training ends (train.stop_at_step always saves).")
    keep_last: int = opt(0, "Keep only the newest N published checkpoints (0 = keep all).")
    fsync: bool = opt(True, "fsync files and directories before publishing.")
    write_threads: int = opt(
        2, "DCP writer threads per rank (each writes its own shard file of the version)."
    )
    format: str = opt(
        "raw",
        "Byte layout of the DCP shards: raw (tensor bytes + index, fastest) | dcp (torch_save "
        "records, readable by torch's DCP tools). Both load either way.",
    )
    async_save: bool = opt(False, "Save with dcp.async_save on a dedicated process group.")
    resume: str = opt("", "'' = fresh run; auto = newest complete checkpoint; or a name/path.")
    load_optimizer: bool = opt(
        True, "Restore optimizer and scheduler on resume (false = weights only)."
    )
    save_optimizer: bool = opt(
        True,
        "Save the whole run state (false = weights-only checkpoints: model and config only, "
        "which a full resume refuses).",
    )
    save_on_signal: bool = opt(
        True, "On SIGTERM/SIGINT: finish the step, save a checkpoint, exit non-zero."
    )
    overwrite: bool = opt(
        False,
        "Allow a fresh run (checkpoint.resume empty) in a run dir that already holds "
        "checkpoints; their names are then re-pointed at the new run's versions.",
    )

    def root_dir(self, run_dir: str | Path) -> Path:
        """``checkpoint.root``, or ``<run.dir>/checkpoints`` when unset."""
        return Path(self.root) if self.root else Path(run_dir) / "checkpoints"


@dataclass
class ExportConfig:
    """Model exports of a run, published in <run.dir>/exports (see docs/exports.md)."""

    hf: bool = opt(True, "Write Hugging Face exports (hf_final at train.max_steps).")
    every_steps: int = opt(
        0, "Also export hf_step_<8 digits> every N optimizer steps (0 = only at the end)."
    )
    dtype: str = opt("bf16", "Export dtype: bf16 | fp32 | preserve.")
    max_shard_size_mb: int = opt(
        2048, "Shard model.safetensors above this size (MiB; 0 = one tensor per shard)."
    )
    merge_lora: bool = opt(
        False, "LoRA runs: export the merged full model instead of the PEFT adapter directory."
    )


@dataclass
class WandbConfig:
    mode: str = opt("disabled", "disabled | offline | online (online needs WANDB_API_KEY).")
    project: str = opt("veoptim", "wandb project.")
    entity: str = opt("", "wandb entity (team); empty = default.")


@dataclass
class LoggingConfig:
    log_every: int = opt(1, "Log metrics every N optimizer steps.")
    progress: bool = opt(True, "Show a progress bar on rank 0.")
    metrics_file: str = opt("metrics.jsonl", "Metrics JSONL file name inside run.dir.")
    level: str = opt("INFO", "Log level of rank 0 (other ranks log warnings only).")
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = opt(
        False,
        "Write TensorBoard event files to <run.dir>/tensorboard (needs the tensorboard extra).",
    )


@dataclass
class TrainerConfig:
    """The config every task shares. A task subclasses it, adds its own sections (its
    ``data`` section, say) and builds its objective from them in ``build_objective``."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def check_task_keys(self) -> None:
        """The task's own refusals of shared keys, checked before any other (none here)."""

    def build_objective(self, tokenizer: Any) -> Any:
        """The task's objective (``veoptim.trainer.objective.Objective``) for this config."""
        raise ConfigError(
            f"{type(self).__name__} is the shared base config and defines no objective; "
            "run a task (e.g. python -m tasks.sft)."
        )

    def build_eval_objective(self, tokenizer: Any) -> Any:
        """The task's objective over ``data.eval_path``: ``build_objective`` with
        ``data.train_path`` swapped for it, so the eval file is read exactly like the
        training file. Evaluation uses only its examples (``micro_batch``); the loss is the
        training objective's, with whatever it set up (DPO's reference)."""
        if not hasattr(self.data, "train_path"):
            raise ConfigError(
                f"data.eval_path is set, but {type(self.data).__name__} has no data.train_path "
                "to read it like; use data.eval_fraction for this task."
            )
        data = dataclasses.replace(self.data, train_path=self.data.eval_path)
        return dataclasses.replace(self, data=data).build_objective(tokenizer)
