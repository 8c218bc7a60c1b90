"""KV memory: request slots -> token slots -> K/V tensors.

`ReqToTokenPool` maps a request slot to the row of KV slot indices its tokens occupy.
`TokenToKVPool` holds preallocated K and V per layer, indexed by slot. Slot 0 is a reserved
scratch slot (padding writes land there), so usable slots are 1..size."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, num_slots: int, max_context_len: int, device: str) -> None:
        self.size = num_slots
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((num_slots, max_context_len), dtype=torch.int64, device=device)
        # Kept sorted so that allocation order is deterministic on every rank.
        self.free_slots = list(range(num_slots))

    def alloc(self) -> int | None:
        return self.free_slots.pop(0) if self.free_slots else None

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
        self.free_slots.sort()

    def available_size(self) -> int:
        return len(self.free_slots)


class TokenToKVPoolAllocator:
    """Free list of KV slots. Allocation takes the lowest free slots, so it is deterministic."""

    def __init__(self, size: int, device: str) -> None:
        self.size = size
        self.device = device
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self.free_slots = torch.cat((self.free_slots, indices.to(self.free_slots.device)))


class TokenToKVPool:
    def __init__(self, size: int, layer_ids: range, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        shape = (size + 1, num_kv_heads, head_dim)
        # Keyed by global layer id: a pipeline stage holds K/V for its own layers only.
        self.k_buffer = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v_buffer = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V rounded to the pool's type (--kv-cache-dtype) by torch's conversion, as the compiled
        decoder layer rounds them."""
        kb, vb = self.k_buffer[layer], self.v_buffer[layer]
        kb[loc] = k.to(kb.dtype)
        vb[loc] = v.to(vb.dtype)
