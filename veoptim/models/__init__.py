"""Model construction from config (transformers classes) or a local HF directory."""

from veoptim.models.build import SUPPORTED_ARCHS, build_model

__all__ = ["SUPPORTED_ARCHS", "build_model"]
