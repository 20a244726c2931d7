"""Model construction from config (transformers classes) or a local HF directory."""

from veoptim.models.build import DTYPES, SUPPORTED_ARCHS, build_model, resolve_dtype

__all__ = ["DTYPES", "SUPPORTED_ARCHS", "build_model", "resolve_dtype"]
