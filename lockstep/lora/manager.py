"""The scheduler's side of LoRA: the adapters loaded in host memory (by name), and which of them
are resident in the batch's `--max-loras-per-batch` slots.

Every rank keeps the same store and makes the same choices: loads and unloads arrive as inputs
(broadcast like requests), and residency is decided at admission from the queues and the step
count alone, so the ranks' slots agree without a message. A request whose adapter is not
resident waits in the queue until a slot is free of running requests; the least recently used
such slot is refilled. A request holds its adapter object, so unloading a name refuses new
requests for it at once while those already queued finish with the weights they began with."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from lockstep.configs.model_config import ModelConfig
from lockstep.lora.adapter import AdapterError, LoraAdapter, fits_error, read_peft
from lockstep.lora.gguf_adapter import is_gguf, read_gguf_lora
from lockstep.lora.layers import LoraLayers, slot_dtype
from lockstep.messages import LoadLoraAdapterReq, LoraUpdateOut, UnloadLoraAdapterReq

logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, layers: LoraLayers, model_cfg: ModelConfig, max_rank: int,
                 targets: frozenset[str], max_loaded: int | None) -> None:
        self.layers = layers
        self.model_cfg = model_cfg
        self.max_rank = max_rank
        self.targets = targets
        self.max_loaded = max_loaded
        self.adapters: dict[str, LoraAdapter] = {}
        self._uids = itertools.count(1)  # the order of loads: the same on every rank
        self.slots: list[LoraAdapter | None] = [None] * layers.n_slots
        self.last_used = [0] * layers.n_slots  # scheduler step of each slot's last admission

    # ---- the store

    def listing(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    def load(self, name: str, path: str) -> LoraUpdateOut:
        """Read and check the adapter; nothing loaded changes unless it fits."""
        if name in self.adapters:
            return self._failed(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            return self._failed(f"{len(self.adapters)} LoRA adapters are loaded, the most this server "
                                f"holds (--max-loaded-loras {self.max_loaded}); unload one first")
        try:
            adapter = read_adapter(name, path, self.model_cfg)
        except AdapterError as e:
            return self._failed(str(e), e.status)
        except OSError as e:
            return self._failed(f"LoRA adapter {name!r}: {e}")
        if (why := fits_error(adapter, self.max_rank, self.targets)) is not None:
            return self._failed(why)
        adapter.uid = next(self._uids)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank,
                    ", ".join(sorted(adapter.config.targets)))
        return LoraUpdateOut(True, adapters=self.listing())

    def unload(self, name: str, in_use: Iterable[LoraAdapter], before_write: Callable[[], object]
               ) -> LoraUpdateOut:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return self._failed(f"LoRA adapter {name!r} is not loaded", 404)
        if adapter in self.slots and all(a is not adapter for a in in_use):
            before_write()  # a batch in flight may still read the slot
            slot = self.slots.index(adapter)
            self.layers.set_slot(slot, None)
            self.slots[slot] = None
        logger.info("LoRA adapter %r unloaded", name)
        return LoraUpdateOut(True, adapters=self.listing())

    def update(self, msg: LoadLoraAdapterReq | UnloadLoraAdapterReq, in_use: Iterable[LoraAdapter],
               before_write: Callable[[], object]) -> LoraUpdateOut:
        if isinstance(msg, LoadLoraAdapterReq):
            return self.load(msg.lora_name, msg.lora_path)
        return self.unload(msg.lora_name, in_use, before_write)

    def _failed(self, message: str, status: int = 400) -> LoraUpdateOut:
        return LoraUpdateOut(False, message, status, self.listing())

    def lookup(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})", 404)
        return adapter

    # ---- the slots

    def make_resident(self, adapter: LoraAdapter, in_use: Iterable[LoraAdapter], now: int,
                      before_write: Callable[[], object]) -> bool:
        """Whether `adapter` is in a slot, putting it into a free one (empty, else the least
        recently used of those no request in `in_use` needs) if it was not; False: it waits."""
        if adapter in self.slots:
            slot = self.slots.index(adapter)
        else:
            busy = {id(a) for a in in_use}
            free = [i for i, a in enumerate(self.slots) if a is None or id(a) not in busy]
            if not free:
                return False
            slot = min(free, key=lambda i: (self.slots[i] is not None, self.last_used[i], i))
            before_write()  # a batch in flight may still read the slot
            self.layers.set_slot(slot, adapter)
            self.slots[slot] = adapter
        self.last_used[slot] = now
        return True

    def grouped(self, reqs: list) -> list:
        """`reqs` (scheduler Reqs) stably ordered by slot, the base's first: each adapter's rows
        of a decode batch are then one run, multiplied without gathering them (a request's
        numbers do not depend on its place in the batch)."""
        return sorted(reqs, key=lambda r: self.slot_of(r.lora))

    def slot_of(self, adapter: LoraAdapter | None) -> int:
        """The adapter's slot (it must be resident: admitted requests' are), -1 for the base."""
        return -1 if adapter is None else self.slots.index(adapter)


DEFAULT_MAX_RANK = 64  # --max-lora-rank when neither it nor --lora-paths says


def create_lora_manager(args, runner) -> LoraManager:  # noqa: ANN001 - ServerArgs, ModelRunner
    """The scheduler's LoraManager, its model's linears adapted, the --lora-paths adapters loaded.
    Unset --max-lora-rank and --lora-target-modules are the largest rank and the union of the
    targets of --lora-paths (SGLang's rule), else 64 and every linear."""
    from lockstep.lora.adapter import TARGET_MODULES, parse_lora_paths, parse_targets

    cfg = runner.model_cfg
    first = [read_adapter(name, path, cfg) for name, path in parse_lora_paths(args.lora_paths).items()]
    targets = parse_targets(args.lora_target_modules) or (
        frozenset().union(*(a.config.targets for a in first)) if first else frozenset(TARGET_MODULES))
    max_rank = args.max_lora_rank or max((a.rank for a in first), default=DEFAULT_MAX_RANK)
    target = runner.weight_plan.target
    runner.lora = LoraLayers(runner.model, targets, args.max_loras_per_batch, max_rank,
                             slot_dtype(target, args.lora_dtype), target.device)
    manager = LoraManager(runner.lora, cfg, max_rank, targets, args.max_loaded_loras)
    for adapter in first:
        done = manager.load(adapter.name, adapter.path)
        if not done.success:
            raise ValueError(f"--lora-paths: {done.message}")
    return manager


def lora_of(manager: LoraManager | None, name: str) -> LoraAdapter:
    """The adapter a request names (AdapterError: off, or not loaded)."""
    if manager is None:
        raise AdapterError(f"lora_path {name!r}: this server serves no LoRA adapters (start it "
                           "with --enable-lora or --lora-paths)")
    return manager.lookup(name)


def read_adapter(name: str, path: str, cfg: ModelConfig) -> LoraAdapter:
    """A PEFT directory, or llama.cpp's GGUF LoRA file (a path ending .gguf)."""
    if is_gguf(path):
        return read_gguf_lora(name, path, cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    return read_peft(name, path, cfg.num_layers)
