"""Building and loading the compiled kernels: the C++ sources in csrc/ (one per op, register.cpp binds
them), built as an AVX2 and an AVX-512 variant.

Each variant compiles on first use with torch.utils.cpp_extension into
`<cache>/kernels/<hash of source, flags, torch version and variant>/` (cache: lockstep.utils.cache),
under a file lock, so two processes starting together (TP ranks) build it once.
Which variant serves is decided once per process from the CPU's flags, or forced with
LOCKSTEP_KERNEL_ISA=avx2|avx512|torch. A failed build is logged once, with why, and the torch reference serves.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from lockstep.utils.cache import cache_dir, cache_lock

logger = logging.getLogger(__name__)

ISA_ENV = "LOCKSTEP_KERNEL_ISA"
VARIANTS = ("avx512", "avx2")
CSRC = Path(__file__).parent / "csrc"
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-mfma", "-mf16c"]
CFLAGS = {  # each variant's compiler flags
    "avx2": [*_COMMON_FLAGS, "-mavx2"],
    "avx512": [*_COMMON_FLAGS, "-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DLOCKSTEP_AVX512"],
}

# what a variant needs from the CPU (names as /proc/cpuinfo spells them)
REQUIRED_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
}


# the opt-in bfloat16 path (AVX-512 build only) runs AMX tiles
AMX_BF16_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


class KernelBuildError(RuntimeError):
    pass


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


# the AVX-512 variant's int8 path (int8.h) runs VNNI's dpbusd
INT8_VNNI_FLAGS = ("avx512_vnni",)


def missing_flags(variant: str) -> list[str]:
    """The CPU flags `variant` needs that this CPU lacks ("amx_bf16": the AMX bfloat16 path,
    "int8_vnni": the AVX-512 variant's int8 path)."""
    extra = {"amx_bf16": AMX_BF16_FLAGS, "int8_vnni": INT8_VNNI_FLAGS}
    needed = (*REQUIRED_FLAGS["avx512"], *extra[variant]) if variant in extra else REQUIRED_FLAGS[variant]
    return [f for f in needed if f not in cpu_flags()]


def _build_dir(variant: str) -> tuple[str, Path]:
    key = hashlib.sha256()
    sources = sorted(f for f in CSRC.iterdir() if f.suffix in (".cpp", ".h"))
    for part in (*(f.read_bytes() for f in sources), torch.__version__.encode(), variant.encode(),
                 " ".join(CFLAGS[variant]).encode(), sys.version.encode()):
        key.update(part)
        key.update(b"\0")
    digest = key.hexdigest()[:16]
    return f"lockstep_kernels_{variant}_{digest}", cache_dir("kernels", f"{variant}-{digest}")


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja`; the PyPI ninja package puts it beside the interpreter, maybe off PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # noqa: PLC0415
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _import_built(name: str, so: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_variant(variant: str) -> ModuleType:
    """The compiled module of `variant`, building it first if the cache lacks it. KernelBuildError on failure."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; choose from {VARIANTS}")
    name, build_dir = _build_dir(variant)
    done = build_dir / "built"  # written after a complete build: a killed link leaves no usable-looking .so
    build_dir.mkdir(parents=True, exist_ok=True)
    if not done.exists():
        with cache_lock(build_dir / "build.flock"):
            if not done.exists():
                module = _compile(variant, name, build_dir)
                done.write_text(torch.__version__)
                return module
    try:
        return _import_built(name, build_dir / f"{name}.so")
    except (ImportError, OSError) as e:
        done.unlink(missing_ok=True)  # a damaged build: the next process compiles it again
        raise KernelBuildError(f"loading the built {variant} kernels failed: {e}") from e


def _compile(variant: str, name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension  # noqa: PLC0415  (slow import, only when building)

    _ensure_ninja_on_path()
    stale = build_dir / "lock"  # cpp_extension's own baton, left behind by a killed build
    stale.unlink(missing_ok=True)
    logger.info("compiling lockstep CPU kernels (%s) into %s ...", variant, build_dir)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name, sources=[str(f) for f in sorted(CSRC.glob("*.cpp"))],
            extra_cflags=CFLAGS[variant], extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir), verbose=False)
    except Exception as e:  # a compiler error, no compiler, no ninja: all mean "serve on torch"
        tail = " | ".join(str(e).strip().splitlines()[-3:])  # the compiler's last words, not the command
        raise KernelBuildError(f"building the {variant} kernels failed: {tail}") from e
    logger.info("lockstep CPU kernels (%s) built in %.0f s", variant, time.perf_counter() - start)
    return module


@functools.cache
def selected() -> tuple[str, ModuleType | None]:
    """(variant, module) serving this process, decided once: the env override, else the best the CPU runs."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced and forced not in (*VARIANTS, "torch"):
        raise ValueError(f"{ISA_ENV}={forced!r}: choose avx512, avx2 or torch")
    variant = forced or next((v for v in VARIANTS if not missing_flags(v)), "torch")
    if variant == "torch":
        why = f"{ISA_ENV}=torch" if forced else "this CPU lacks AVX2/FMA/F16C"
        logger.info("lockstep CPU kernels: serving on the torch reference (%s)", why)
        return "torch", None
    lacking = missing_flags(variant)
    if lacking:
        logger.warning("lockstep CPU kernels: %s=%s but this CPU lacks %s; serving on the torch reference",
                       ISA_ENV, variant, ", ".join(lacking))
        return "torch", None
    try:
        module = load_variant(variant)
    except (KernelBuildError, OSError) as e:  # OSError: e.g. a cache directory we may not write
        logger.warning("lockstep CPU kernels unavailable, serving on the torch reference: %s", e)
        return "torch", None
    logger.info("lockstep CPU kernels: %s variant%s", variant, " (forced)" if forced else "")
    return variant, module
