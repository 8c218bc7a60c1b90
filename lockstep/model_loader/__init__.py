"""Model loading: resolve a GGUF file or HF directory to a validated source, and stream its weights
(a GGUF's in their quantized blocks)."""

from lockstep.model_loader.source import ModelLoadError, ModelSource, resolve_model
from lockstep.model_loader.weights import iter_weights

__all__ = ["ModelLoadError", "ModelSource", "iter_weights", "resolve_model"]
