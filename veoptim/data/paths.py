"""Where the bundled assets live inside the package (file names as constants)."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_DIR = "tokenizer"
SFT_TRAIN_FILE = "data/sft_train.jsonl"
SFT_SAMPLE_FILE = "data/sft_sample_prompt_response.jsonl"
DPO_PAIRS_FILE = "data/dpo_pairs.jsonl"


def bundled_tokenizer_dir() -> Path:
    """Directory of the bundled byte-level BPE tokenizer (loadable by ``AutoTokenizer``)."""
    return ASSETS_DIR / TOKENIZER_DIR


def bundled_dataset_path() -> Path:
    """The bundled synthetic SFT dataset (chat JSONL)."""
    return ASSETS_DIR / SFT_TRAIN_FILE


def bundled_sample_path() -> Path:
    """A tiny ``prompt``/``response`` JSONL sample (for docs and tests)."""
    return ASSETS_DIR / SFT_SAMPLE_FILE


def bundled_pairs_path() -> Path:
    """The bundled preference pairs (correct vs corrupted answers of the SFT tasks)."""
    return ASSETS_DIR / DPO_PAIRS_FILE
