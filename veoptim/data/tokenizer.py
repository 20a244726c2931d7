"""Load a fast tokenizer offline: the bundled one by default, or any local HF tokenizer dir."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from veoptim.data.paths import bundled_tokenizer_dir
from veoptim.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def load_tokenizer(path: str = "") -> PreTrainedTokenizerFast:
    """Load the tokenizer at ``path`` ('' = bundled) with ``AutoTokenizer``, local files only.

    SFT needs a fast tokenizer (character offsets locate the assistant turns) and
    a chat template. A tokenizer without a pad token pads with its EOS token.
    """
    directory = Path(path) if path else bundled_tokenizer_dir()
    if not directory.is_dir():
        raise DataError(
            f"data.tokenizer_path must be a tokenizer directory; {directory} does not exist."
        )
    if not any((directory / name).is_file() for name in (TOKENIZER_FILE, CONFIG_FILE)):
        raise DataError(
            f"tokenizer directory {directory} has neither {TOKENIZER_FILE} nor {CONFIG_FILE}."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
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
