"""veoptim: exact-precision, recoverable fine-tuning for causal language models."""

__version__ = "0.1.0"
