"""What the loader modules share: the error they raise and the name of the GGUF tensor index."""

from __future__ import annotations

# Written by gguf_loader at the first start, read by source (to validate) and weights (to load).
TENSOR_INDEX = "gguf_tensors.json"


class ModelLoadError(Exception):
    """A model file is missing, truncated, corrupt or unsupported; the message names the file."""
