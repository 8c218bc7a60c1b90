"""`--model-path` as one validated model source: a packaged model's short name stands for its
file (lockstep.model_loader.packaged); a GGUF is described once into
``<cache>/<sha256[:16]>-blocks/`` (HF config, tokenizer, tensor index; the weights stay in the
GGUF), an HF directory is checked and used in place. Anything wrong with the user's files is a
`ModelLoadError` naming the file: one line from the CLI, not a traceback."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from lockstep.model_loader.layout import TENSOR_INDEX, ModelLoadError
from lockstep.model_loader.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from lockstep.utils.cache import cache_dir as lockstep_cache_dir
from lockstep.utils.cache import cache_lock

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so caches written by older code get rebuilt.
# 3: a GGUF's pooling key is written as sentence-transformers modules (gguf_encoder).
CONVERSION_FORMAT = 3
# Format 1 wrote float32 safetensors into <sha256[:16]>/; this one keeps the GGUF's blocks.
_CACHE_SUFFIX = "-blocks"
CONVERSION_MARKER = "lockstep_conversion.json"
_HASH_MEMO = "gguf_sha256.json"
_GGUF_MAGIC = b"GGUF"


__all__ = ["ModelLoadError", "ModelSource", "resolve_model"]


@dataclass(frozen=True)
class ModelSource:
    model_dir: Path  # config.json + tokenizer files (+ *.safetensors for an HF directory)
    hf_config: dict  # parsed config.json
    weight_files: tuple[Path, ...]  # safetensors files; empty for a GGUF
    chat_template: str | None  # None if the model has none
    origin: str  # what the user passed (GGUF path or dir)
    # The GGUF whose tensors model_dir/gguf_tensors.json indexes; None for an HF directory.
    gguf_file: Path | None = None


def resolve_model(model_path: str | None, cache_dir: Path | None = None) -> ModelSource:
    """Validated HF-format source for `model_path`: a packaged model's short name
    (lockstep.model_loader.packaged; None: the default one), a GGUF file or an HF directory."""
    start = time.perf_counter()
    name = DEFAULT_MODEL if model_path is None else model_path
    packaged = PACKAGED_MODELS.get(name)
    path = packaged.path() if packaged else Path(name).expanduser()
    origin = str(path) if packaged else name  # a packaged model's origin is its file
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory{_not_a_short_name(name)}")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            raise ModelLoadError(f"{path / 'config.json'}: missing model config; to load "
                                 f"{ggufs[0].name}, pass the .gguf file itself")
        source = load_hf_dir(path, origin)
        logger.info("loaded %s in %.2f s", path, time.perf_counter() - start)
        return source
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    if magic != _GGUF_MAGIC and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: neither a .gguf file nor an HF model directory")
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return _resolve_gguf(path, origin, Path(cache_dir) if cache_dir else lockstep_cache_dir(), start)


def _not_a_short_name(name: str) -> str:
    """For a missing path written like a short name (no folder, no suffix): the names there are."""
    if "/" in name or Path(name).suffix:
        return ""
    return (f", nor a packaged model ({', '.join(PACKAGED_MODELS)}; `lockstep models` "
            "lists them)")


def _resolve_gguf(path: Path, origin: str, cache_dir: Path, start: float) -> ModelSource:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"{cache_dir}: cannot create the model cache directory: {e}") from e
    digest = _content_sha256(path, cache_dir)
    target = cache_dir / f"{digest[:16]}{_CACHE_SUFFIX}"
    if (cached := _load_cached(target, origin, path)) is None:
        with cache_lock(cache_dir / f".{target.name}.lock"):
            # Another process may have finished the conversion while we waited for the lock.
            if (cached := _load_cached(target, origin, path)) is None:
                _convert_into(path, digest, target)
                source = _load_converted(target, origin, path)
                logger.info("%s: converted in %.2f s (%s)", path, time.perf_counter() - start,
                            target)
                return source
    logger.info("%s: loaded from cache in %.2f s (%s)", path, time.perf_counter() - start, target)
    return cached


def _load_cached(target: Path, origin: str, gguf_path: Path) -> ModelSource | None:
    marker = _read_json_or_none(target / CONVERSION_MARKER)
    if not isinstance(marker, dict) or marker.get("format") != CONVERSION_FORMAT:
        return None
    try:
        source = _load_converted(target, origin, gguf_path)
    except ModelLoadError as e:
        # The cache is ours to rebuild: a damaged one is replaced, not reported.
        logger.warning("%s: damaged cache entry, converting again: %s", target, e)
        return None
    recorded = marker.get("source")
    if recorded != str(gguf_path) and not (isinstance(recorded, str) and Path(recorded).is_file()):
        # The entry is keyed by content: the file it was converted from may be gone (a deleted copy,
        # a test's temporary directory) while this one has the same bytes. Its marker names a file
        # that exists, so what reads the weights from the marker finds them.
        marker["source"] = str(gguf_path)
        with contextlib.suppress(OSError):  # a read-only shared cache keeps its old marker
            tmp = target / f".{CONVERSION_MARKER}.{os.getpid()}"
            tmp.write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(tmp, target / CONVERSION_MARKER)
    return source


def _load_converted(target: Path, origin: str, gguf_path: Path) -> ModelSource:
    index = _read_json(target / TENSOR_INDEX, "tensor index")
    tensors = index.get("tensors") if isinstance(index, dict) else None
    if not isinstance(tensors, dict) or not tensors:
        raise ModelLoadError(f"{target / TENSOR_INDEX}: no tensors in the index")
    if index.get("gguf_size") != gguf_path.stat().st_size:
        raise ModelLoadError(f"{target / TENSOR_INDEX}: indexes a file of another size")
    return load_hf_dir(target, origin, gguf_path)


def _convert_into(path: Path, digest: str, target: Path) -> None:
    # Imported here: gguf + transformers cost seconds and only a first conversion needs them.
    import lockstep.model_loader.gguf_loader as gguf_loader

    cache_dir = target.parent
    # Left by a crashed conversion; only safe to delete while we hold the lock.
    for stale in cache_dir.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
    try:
        gguf_loader.convert_gguf(path, tmp)
        marker = {"format": CONVERSION_FORMAT, "source": str(path), "sha256": digest}
        (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp and some writers create owner-only entries; a cache may be shared by users.
        for entry in tmp.rglob("*"):
            entry.chmod(0o755 if entry.is_dir() else 0o644)
        tmp.chmod(0o755)
        if target.exists():  # an outdated or damaged entry: move it aside, never half-delete it
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
            os.rename(target, old / "old")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
    except OSError as e:
        raise ModelLoadError(f"{target}: cannot write the converted model: {e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _content_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of the file, memoized by (path, size, mtime) so restarts do not re-read it."""
    try:
        st = path.stat()
        memo_path = cache_dir / _HASH_MEMO
        memo = _read_json_or_none(memo_path)
        memo = memo if isinstance(memo, dict) else {}
        ident = str(path.resolve())
        entry = memo.get(ident)
        if isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns]:
            return str(entry[2])
        with path.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256")
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    memo[ident] = [st.st_size, st.st_mtime_ns, digest.hexdigest()]
    with contextlib.suppress(OSError):  # only a speed-up: losing it costs one re-hash
        _atomic_write_text(memo_path, json.dumps(memo, indent=1))
    return digest.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_hf_dir(model_dir: Path, origin: str, gguf_file: Path | None = None) -> ModelSource:
    """Check an HF model directory and describe it; only headers are read, never tensor data.
    A GGUF's converted directory (`gguf_file`) has no weight files: they stay in the GGUF."""
    hf_config = _read_json(model_dir / "config.json", "model config")
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise ModelLoadError(f"{model_dir / 'config.json'}: not an HF model config (no model_type)")
    weight_files = () if gguf_file is not None else _weight_files(model_dir)
    for f in weight_files:
        check_safetensors(f)
    if not _has_tokenizer(model_dir):
        raise ModelLoadError(
            f"{model_dir}: no tokenizer (expected tokenizer.json, tokenizer.model or vocab.json)")
    return ModelSource(model_dir, hf_config, weight_files, _chat_template(model_dir), origin,
                       gguf_file)


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable {what}: {e}") from e


def _weight_files(model_dir: Path) -> tuple[Path, ...]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return (single,)
    index_path = model_dir / "model.safetensors.index.json"
    if not index_path.is_file():
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                             "(only safetensors weights are supported)")
    index = _read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path}: no weight_map in the safetensors index")
    files = tuple(model_dir / name for name in sorted(set(map(str, weight_map.values()))))
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: shard listed in {index_path.name} is missing")
    return files


def check_safetensors(path: Path) -> None:
    """Catch truncated or corrupt safetensors files up front: opening one reads its header alone
    and checks that the file covers every tensor listed there."""
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except Exception as e:  # safetensors raises its own untyped errors for bad files
        raise ModelLoadError(f"{path}: corrupt or truncated safetensors file: {e}") from e


def _has_tokenizer(model_dir: Path) -> bool:
    def ok(name: str) -> bool:
        f = model_dir / name
        return f.is_file() and f.stat().st_size > 0

    return ok("tokenizer.json") or ok("tokenizer.model") or (ok("vocab.json") and ok("merges.txt"))


def _chat_template(model_dir: Path) -> str | None:
    # Same precedence as transformers 5: the .jinja file, then chat_template.json, then the config.
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja}: unreadable chat template: {e}") from e
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            data = _read_json(model_dir / name, "tokenizer config")
            template = data.get("chat_template") if isinstance(data, dict) else None
            if template:
                return _pick_template(template)
    return None


def _pick_template(template: Any) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None
