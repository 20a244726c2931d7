"""What a training checkpoint version holds: every file name, key and the format version.

Inside a published version directory (see ``layout.py`` for names and versions)::

    manifest.json             written last by the publisher; lists every file below
    checkpoint.json           format, format version, step, world size, parallel layout
                              and the list of state components with what each saved
    dcp/                      torch.distributed.checkpoint: tensors only, sharded by rank
      .metadata                 keys ``<component>.<key>``, e.g. ``model.<fqn>``
      __<rank>_<n>.distcp      one file per writer thread (checkpoint.write_threads)
    state/<component>.json    JSON state shared by all ranks (written by rank 0)
    state/<component>/rank_<r>.json   JSON state of rank r (e.g. RNG states)

No file is ever unpickled on load: tensors come from DCP shards (its metadata is
read with an allow-list unpickler), everything else is JSON.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_FORMAT = "veoptim.training_checkpoint"
#: 2: named state components (version 1 had a fixed set of files; it is refused).
CHECKPOINT_FORMAT_VERSION = 2

INFO_FILE = "checkpoint.json"
DCP_DIR = "dcp"
STATE_DIR = "state"
SHARED_JSON_FORMAT = "{name}.json"
RANK_JSON_FORMAT = "rank_{rank:05d}.json"

# checkpoint.json keys
INFO_FORMAT = "format"
INFO_FORMAT_VERSION = "format_version"
INFO_STEP = "step"
INFO_WORLD_SIZE = "world_size"
INFO_LAYOUT = "layout"
#: True for a weights-only ("sampler") checkpoint: a subset of the run's components.
INFO_WEIGHTS_ONLY = "weights_only"
INFO_COMPONENTS = "components"
# per-component entry of checkpoint.json
COMPONENT_TENSORS = "tensors"
COMPONENT_JSON = "json"
JSON_SHARED = "shared"
JSON_PER_RANK = "per_rank"


def shared_json_path(version: Path, name: str) -> Path:
    """The JSON file of component ``name`` shared by every rank."""
    return version / STATE_DIR / SHARED_JSON_FORMAT.format(name=name)


def rank_json_path(version: Path, name: str, rank: int) -> Path:
    """The JSON file of component ``name`` written by ``rank``."""
    return version / STATE_DIR / name / RANK_JSON_FORMAT.format(rank=rank)
