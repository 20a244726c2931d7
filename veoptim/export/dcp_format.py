"""``veoptim-export --format dcp``: a training checkpoint rewritten in DCP's own shard layout.

veoptim writes its shards in the ``raw`` layout by default (``checkpoint.format``), which
only veoptim reads. This writer produces a copy of the whole checkpoint (every component:
``checkpoint.json``, ``state/``, and ``dcp/`` with the same keys and nesting) whose shards
are DCP's ``torch_save`` records, so torch's own tools read it
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``) and veoptim resumes from
it like from the original. The tensors are copied exactly (``--dtype`` does not apply);
the host holds every tensor of the checkpoint, unsharded, while it converts. The copy
itself is the checkpoint package's (``copy_with_dcp_shards``): shards are its business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from veoptim.checkpoint import copy_with_dcp_shards


def write_dcp(source: Any, out_dir: Path, options: Any) -> None:
    """Copy ``source``'s checkpoint (a ``CheckpointSource``) into ``out_dir`` with DCP
    ``torch_save`` shards. The registry's one checkpoint-copying entry: it copies a
    checkpoint, not a model, so it gets the checkpoint rather than a ``ModelState`` and has
    no live export."""
    copy_with_dcp_shards(source.version, out_dir)
