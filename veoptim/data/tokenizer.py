"""Load a fast tokenizer offline: the bundled one by default, or any local HF tokenizer dir."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from veoptim.data.chat_templates import apply_choice, check_choice
from veoptim.data.paths import bundled_tokenizer_dir
from veoptim.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
#: Classes a tokenizer saves when it is plain tokenizer.json (the bundled one and its exports).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_class(directory: Path) -> str | None:
    """The ``tokenizer_class`` that ``tokenizer_config.json`` declares, if readable."""
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get(
            "tokenizer_class"
        )
    except (OSError, ValueError, AttributeError):
        return None


def _from_pretrained(directory: Path) -> PreTrainedTokenizerFast:
    """``AutoTokenizer``, except that a generic tokenizer stays generic.

    Next to a model's config.json, AutoTokenizer picks the class from the model type
    (qwen2: Qwen2Tokenizer), which adds its own ``<|endoftext|>`` token: the bundled
    512-token tokenizer of an exported model would load with 513 tokens, one more than
    the model's vocabulary. The class the directory declares is what was saved.
    """
    if _declared_class(directory) in GENERIC_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenizer_source(tokenizer_path: str, model_path: str = "") -> tuple[str, str]:
    """``(directory, config key)`` of the run's tokenizer: ``data.tokenizer_path`` if set,
    else the model's own directory (``model.path``), else '' (the bundled tokenizer).

    A model loaded from a directory is trained with the tokenizer it was trained with;
    the bundled 512-token tokenizer would silently mismatch its embeddings.
    """
    if tokenizer_path:
        return tokenizer_path, "data.tokenizer_path"
    if model_path:
        return model_path, "model.path"
    return "", "data.tokenizer_path"


def load_tokenizer(
    path: str = "", model_path: str = "", chat_template: str = ""
) -> PreTrainedTokenizerFast:
    """Load the tokenizer at ``path`` (else at ``model_path``, else the bundled one) with
    ``AutoTokenizer``, local files only; ``chat_template`` (``data.chat_template``: a
    template name or a Jinja file) replaces its chat template.

    SFT needs a fast tokenizer (character offsets locate the assistant turns) and
    a chat template. A tokenizer without a pad token pads with its EOS token.
    """
    check_choice(chat_template)  # an unknown name fails before any file is read
    path, key = tokenizer_source(path, model_path)
    directory = Path(path) if path else bundled_tokenizer_dir()
    if not directory.is_dir():
        raise DataError(f"{key} must be a tokenizer directory; {directory} does not exist.")
    if not any((directory / name).is_file() for name in (TOKENIZER_FILE, CONFIG_FILE)):
        hint = (
            "; set data.tokenizer_path to the model's tokenizer directory"
            if key == "model.path"
            else ""
        )
        raise DataError(
            f"tokenizer directory {directory} ({key}) has neither {TOKENIZER_FILE} "
            f"nor {CONFIG_FILE}{hint}."
        )
    try:
        tokenizer = _from_pretrained(directory)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise DataError(
            f"could not load a tokenizer from {directory} (expected {TOKENIZER_FILE} and "
            f"{CONFIG_FILE} loadable by AutoTokenizer): {str(error).splitlines()[0]}"
        ) from error
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"tokenizer at {directory} is a slow {type(tokenizer).__name__}; "
            f"expected a fast tokenizer ({TOKENIZER_FILE})."
        )
    apply_choice(tokenizer, chat_template, str(directory))
    if not tokenizer.chat_template:
        raise DataError(
            f"tokenizer at {directory} has no chat template; SFT renders examples with it."
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise DataError(
                f"tokenizer at {directory} has neither a pad nor an EOS token to pad with."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The tokenizer's pad/bos/eos ids that are set, as a model config takes them."""
    keys = ("pad_token_id", "bos_token_id", "eos_token_id")
    return {
        key: getattr(tokenizer, key) for key in keys if getattr(tokenizer, key, None) is not None
    }


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides the tokens: vocabulary and merges, added and special tokens, template."""
    backend = (
        tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else repr(tokenizer.get_vocab())
    )
    parts = [
        type(tokenizer).__name__,
        backend,
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
    ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
