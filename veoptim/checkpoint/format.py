"""What a training checkpoint version holds: every file name, key and the format version.

Inside a published version directory (see ``layout.py`` for names and versions)::

    manifest.json          written last by the publisher; lists every file below
    checkpoint.json        format version, step, world size, optimizer type, contents
    dcp/                   torch.distributed.checkpoint: tensors only, sharded by rank
      .metadata              keys ``model.<fqn>`` and ``optimizer.<fqn>.<state key>``
      __<rank>_<n>.distcp   one file per writer thread (checkpoint.write_threads)
    trainer_state.json     progress, sampler position, LR scheduler, optimizer param groups
    rng/rank_<r>.json      Python, NumPy, torch CPU and device RNG states of rank r
    layout.json            mesh dims, EP size, expert placement (``LayoutMetadata``)
    config.yaml            the resolved run config

No file is ever unpickled on load: tensors come from DCP shards (its metadata is
read with an allow-list unpickler), everything else is JSON or YAML.
"""

from __future__ import annotations

CHECKPOINT_FORMAT = "veoptim.training_checkpoint"
CHECKPOINT_FORMAT_VERSION = 1

INFO_FILE = "checkpoint.json"
DCP_DIR = "dcp"
TRAINER_STATE_FILE = "trainer_state.json"
RNG_DIR = "rng"
RNG_FILE_FORMAT = "rank_{rank:05d}.json"
LAYOUT_FILE = "layout.json"
CONFIG_FILE = "config.yaml"

MODEL_PREFIX = "model"
OPTIMIZER_PREFIX = "optimizer"

# checkpoint.json keys
INFO_FORMAT = "format"
INFO_FORMAT_VERSION = "format_version"
INFO_STEP = "step"
INFO_WORLD_SIZE = "world_size"
INFO_OPTIMIZER = "optimizer"
INFO_HAS_OPTIMIZER = "has_optimizer"

# trainer_state.json keys
STATE_PROGRESS = "progress"
STATE_SAMPLER = "sampler"
STATE_SCHEDULER = "scheduler"
STATE_PARAM_GROUPS = "param_groups"
TRAINER_STATE_KEYS = (STATE_PROGRESS, STATE_SAMPLER, STATE_SCHEDULER, STATE_PARAM_GROUPS)

#: Config keys that must match on a full (model + optimizer) resume: they decide the
#: data order, the LR schedule and the optimizer state. Everything else (logging,
#: checkpoint cadence, run dir, stop_at_step, parallel sizes within the optimizer
#: layout rules) may change between slices of a run.
RESUME_MUST_MATCH = (
    "model",
    "data",
    "train.max_steps",
    "train.global_batch_size",
    "train.seed",
    "optim.name",
    "scheduler",
)
#: On a weights-only resume only the model must match (shapes are validated anyway).
WEIGHTS_ONLY_MUST_MATCH = ("model.arch", "model.path")
