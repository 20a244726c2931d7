"""SFT data path: bundled assets, tokenizer, JSONL and Hugging Face ``datasets`` readers,
collation/packing, the sampler.

The trainer uses exactly this API; see ``docs/data.md`` for formats and semantics.
"""

from veoptim.data.collate import collate
from veoptim.data.dataset import SFTDataset, load_sft_dataset
from veoptim.data.fields import IGNORE_INDEX
from veoptim.data.paths import bundled_dataset_path, bundled_sample_path, bundled_tokenizer_dir
from veoptim.data.sampler import GlobalBatchSampler
from veoptim.data.sources import ReadOptions
from veoptim.data.tokenizer import load_tokenizer, special_token_ids

__all__ = [
    "IGNORE_INDEX",
    "GlobalBatchSampler",
    "ReadOptions",
    "SFTDataset",
    "bundled_dataset_path",
    "bundled_sample_path",
    "bundled_tokenizer_dir",
    "collate",
    "load_sft_dataset",
    "load_tokenizer",
    "special_token_ids",
]
