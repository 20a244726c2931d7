"""Imported last by the fork server (``tests/forkserver.py``): tokenizes the bundled SFT
data and the bundled preference pairs as the default configs read them (the bundled
tokenizer, ``data.max_seq_len=96``), so that a rank or task command forked from the server
finds them in the process memo (``veoptim.data.token_memo``) instead of rendering the
chat template ~10,000 times itself. A run that reads anything else tokenizes as usual.
"""

from __future__ import annotations

from veoptim.config.schema import DataConfig
from veoptim.data import load_sft_dataset, load_tokenizer
from veoptim.data.pairs import load_pair_dataset

DEFAULT_MAX_SEQ_LEN = DataConfig().max_seq_len

_tokenizer = load_tokenizer()
load_sft_dataset("", _tokenizer, DEFAULT_MAX_SEQ_LEN, packing=False)
load_pair_dataset("", _tokenizer, DEFAULT_MAX_SEQ_LEN)
del _tokenizer
