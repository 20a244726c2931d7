"""The served tokenizer in the local Hugging Face cache, under the served model's name.

The SDK's ``SamplingClient.get_tokenizer()`` knows only the model's *name*
(``AutoTokenizer.from_pretrained(base_model)``): for a served name that is not a
directory, such as the bundled ``tiny_dense``, that is a Hub lookup, which fails offline.
So at start the server copies its tokenizer files into the Hub cache as the repository of
that name (one snapshot, ``refs/main`` pointing at it, and a ``config.json`` marking it
as the server's), and a client on the same machine and cache loads it offline. A cache
entry of that name that the server did not make (a real Hub download) is left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger("veoptim.service")
#: The tokenizer files copied (a model directory's weights stay where they are).
PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
            "merges.txt", "chat_template*", "*.model", "*.tiktoken")  # fmt: skip
MARKER = "veoptim_served_tokenizer"


def hub_repo_id(name: str) -> str | None:
    """The repository the SDK's tokenizer lookup asks for under model name ``name`` (cut at
    ``:``; ``org/model/variant`` -> ``org/model``), or None when it is not a Hub id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = name.split(":")[0]
    if name.count("/") == 2:
        name = "/".join(name.split("/")[:2])
    if not name or os.path.isabs(name) or Path(name).exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def install_tokenizer(tokenizer_dir: Path, name: str, cache: Path) -> Path | None:
    """Publish the files of ``tokenizer_dir`` in Hub cache ``cache`` as repository ``name``
    (idempotent); the snapshot directory, or None when there is nothing to do."""
    repo = hub_repo_id(name)
    if repo is None:
        return None
    files = sorted(
        {p for pattern in PATTERNS for p in Path(tokenizer_dir).glob(pattern) if p.is_file()}
    )
    if not files:
        return None
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    revision = digest.hexdigest()
    folder = Path(cache) / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / "main"
    current = ref.read_text().strip() if ref.is_file() else None
    if current is not None and not _ours(folder / "snapshots" / current):
        log.info(
            "the Hugging Face cache holds %s already; the served tokenizer is not installed", repo
        )
        return None
    snapshot = folder / "snapshots" / revision
    if current != revision or not snapshot.is_dir():
        _write_snapshot(snapshot, files, name)
        _write_ref(ref, revision)
        log.info("installed the served tokenizer in the Hugging Face cache as %s (%s)", repo, cache)
    return snapshot


def _ours(snapshot: Path) -> bool:
    config = snapshot / "config.json"
    return config.is_file() and MARKER in config.read_text()


def _write_snapshot(snapshot: Path, files: list[Path], name: str) -> None:
    staging = snapshot.with_name(f".{snapshot.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    for path in files:
        shutil.copyfile(path, staging / path.name)
    (staging / "config.json").write_text(json.dumps({MARKER: name}) + "\n")
    shutil.rmtree(snapshot, ignore_errors=True)
    os.replace(staging, snapshot)


def _write_ref(ref: Path, revision: str) -> None:
    ref.parent.mkdir(parents=True, exist_ok=True)
    staging = ref.with_name(f".main.{uuid.uuid4().hex[:8]}")
    staging.write_text(revision)
    os.replace(staging, ref)
