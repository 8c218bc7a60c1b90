"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) read into host
memory, and the checks that it fits the server (rank, target modules) before anything is loaded.

Only what lockstep runs is accepted: plain LoRA on the attention and MLP projections. A config
that asks for more (DoRA, per-module rank patterns, full copies of modules_to_save, LoRA biases)
is refused with its reason, never loaded as something else."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# PEFT's module names, in the order lockstep's fused linears hold their outputs
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ALL = ("all", "all-linear")  # how SGLang and PEFT say "every linear layer"

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter the server cannot load or a request cannot use: `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_targets(names: list[str] | None) -> frozenset[str] | None:
    """--lora-target-modules as a set of PEFT module names (None: not given)."""
    if not names:
        return None
    if any(n in _ALL for n in names):
        return frozenset(TARGET_MODULES)
    bad = [n for n in names if n not in TARGET_MODULES]
    if bad:
        raise ValueError(f"--lora-target-modules: {bad} are not among {list(TARGET_MODULES)} "
                         f"(or {' / '.join(_ALL)})")
    return frozenset(names)


def parse_lora_paths(items: list[str]) -> dict[str, str]:
    """--lora-paths as {name: path}: each item `name=path`, a bare path (named by itself), or a JSON
    object, SGLang's {"lora_name", "lora_path"} or vLLM's {"name", "path"} (--lora-modules)."""
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            name, path = _json_item(item)
        else:
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        if not name or not path:
            raise ValueError(f"--lora-paths {item!r}: give name=path")
        if name in out:
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        out[name] = path
    return out


def _json_item(item: str) -> tuple[str, str]:
    """(name, path) of a JSON --lora-paths item; a key lockstep would not honour is refused."""
    try:
        obj = json.loads(item)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lora-paths {item!r}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--lora-paths {item!r}: a JSON item is an object")
    # refused rather than dropped: SGLang's "pinned" and vLLM's "base_model_name" are not honoured
    if unknown := set(obj) - {"lora_name", "lora_path", "name", "path"}:
        raise ValueError(f"--lora-paths {item!r}: keys {sorted(unknown)} are not served (only the name and path)")
    name, path = obj.get("lora_name", obj.get("name")), obj.get("lora_path", obj.get("path"))
    if not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"--lora-paths {item!r}: give lora_name and lora_path (or name and path) as strings")
    return name, path


def lora_arg_problems(lora_paths: list[str], targets: list[str]) -> list[str]:
    """What is wrong with --lora-paths and --lora-target-modules (ServerArgs' check)."""
    problems = []
    for check, value in ((parse_lora_paths, lora_paths), (parse_targets, targets)):
        try:
            check(value)
        except ValueError as e:
            problems.append(str(e))
    return problems


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str]  # the PEFT modules the adapter's weights cover

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) for rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(eq=False)  # one adapter is one load: compared by identity
class LoraAdapter:
    """An adapter in host memory: per (layer, module) A [r, in] and B [out, r] with the scaling
    folded in, float32, whole (each rank keeps its shard of B when it makes the adapter resident).
    `uid` is unique per load (the radix cache's namespace for this adapter's KV)."""

    name: str
    path: str
    config: LoraConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    uid: int = 0

    @property
    def rank(self) -> int:
        return self.config.rank


def _config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{path}: no adapter_config.json (a PEFT LoRA adapter directory "
                           "holds adapter_config.json and adapter_model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_file}: not JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    refused = [(key, why) for key, why in (
        ("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("modules_to_save", "full copies of modules (modules_to_save)"),
        ("fan_in_fan_out", "transposed (fan_in_fan_out) weights"), ("lora_bias", "LoRA biases"))
        if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        refused.append(("bias", f"trained biases (bias={cfg['bias']!r})"))
    if refused:
        raise AdapterError(f"{path}: {', '.join(why for _, why in refused)} not supported")
    return cfg


def read_peft(name: str, path: str, num_layers: int) -> LoraAdapter:
    """The adapter at `path` (a PEFT directory), checked against a model of `num_layers` layers."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a directory (a PEFT adapter) nor a .gguf file")
    cfg = _config(root)
    files = [root / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise AdapterError(f"{path}: no adapter_model.safetensors")
    try:
        tensors = load_file(str(files[0]))
    except Exception as e:  # noqa: BLE001 - a corrupt file is the client's 400, not a crash
        raise AdapterError(f"{files[0]}: not a safetensors file ({e})") from e
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of "
                               f"{', '.join(TARGET_MODULES)} (the modules lockstep applies adapters to)")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model "
                               f"has {num_layers}")
        parts.setdefault((layer, m.group(2)), {})[m.group(3)] = t.float()
    config = LoraConfig(rank, alpha, bool(cfg.get("use_rslora", False)),
                        frozenset(module for _, module in parts))
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_"
                               f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module}: A {tuple(a.shape)}, "
                               f"B {tuple(b.shape)} do not have rank r={rank}")
        weights[(layer, module)] = (a.contiguous(), (b * config.scaling).contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {files[0]} holds no LoRA weights")
    return LoraAdapter(name, str(path), config, weights)


def fits_error(adapter: LoraAdapter, max_rank: int, targets: frozenset[str]) -> str | None:
    """Why the adapter does not fit a server started for `max_rank` and `targets`, or None."""
    if adapter.rank > max_rank:
        return (f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, more than this server's "
                f"--max-lora-rank {max_rank}")
    extra = sorted(adapter.config.targets - targets)
    if extra:
        return (f"LoRA adapter {adapter.name!r} targets {extra}, beyond this server's "
                f"--lora-target-modules {sorted(targets)}")
    return None
