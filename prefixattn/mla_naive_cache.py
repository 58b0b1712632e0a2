"""The naive form's up-projected prefixes kept across steps (:class:`NaivePrefixCache`), as TyphoonMLA keeps a shared
prefix's keys and values for all the steps of a batch (arXiv 2509.21081).

Without it, :func:`prefixattn.mla_naive_attention` up-projects each group's prefix in every step and layer: per head
and prefix token ``2 x kv_lora_rank x (qk_nope_head_dim + v_head_dim)`` FLOPs and the keys and values written. With
it, a latent block's keys and values are written once into a slot of a per-layer buffer and read from there by every
later step whose plan holds the block; a step up-projects only the blocks it does not find. The buffer's size is the
user's (``max_bytes``: every layer's slots together); where a step's prefix blocks do not all fit, that step
up-projects as without a cache.

Entries are keyed by latent block id: a block's content must not change while the cache holds it. Engines rewrite a
block only after freeing it (vLLM and SGLang share full, immutable prefix blocks), so the caller drops the blocks it
frees or rewrites (:meth:`NaivePrefixCache.forget`); an offline batch's shared prompts never change.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from prefixattn.planner.options import _positive_int


class NaivePrefixCache:
    """Up-projected prefix blocks of the naive form, per layer, kept across steps within ``max_bytes``.

    Parameters
    ----------
    num_layers : int
        Layers that call :func:`prefixattn.mla_naive_attention` with this cache (``layer=0 .. num_layers - 1``).
    max_bytes : int
        The buffers' size, every layer's keys and values together: ``num_layers x block_size x num_heads x
        (qk_nope_head_dim + rope_dim + v_head_dim) x dtype's bytes`` a block (DeepSeek-V3, 128 heads, 16-token
        blocks, bf16: 1.25 MiB a block and layer). ValueError where not one block fits.
    num_heads, block_size, qk_nope_head_dim, rope_dim, v_head_dim : int
        As the plans' (:func:`prefixattn.plan_mla_naive`).
    dtype : torch.dtype
        The queries' dtype (the up-projected keys and values are q's dtype).
    device : torch.device or str, optional
        Where the buffers live (the plans' device); default the current CUDA device, else the CPU.

    Attributes
    ----------
    k : Tensor, ``[num_layers, capacity, block_size, num_heads, qk_nope_head_dim + rope_dim]``
    v : Tensor, ``[num_layers, capacity, block_size, num_heads, v_head_dim]``
    capacity : int
        Blocks it holds.
    step : int
        Plans made with it so far: a layer runs only the latest one (:meth:`check_plan`).
    """

    def __init__(self, *, num_layers: int, max_bytes: int, num_heads: int, block_size: int,
                 qk_nope_head_dim: int = 128, rope_dim: int = 64, v_head_dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        self.num_layers = _positive_int("num_layers", num_layers)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.block_size = _positive_int("block_size", block_size)
        self.key_dim = _positive_int("qk_nope_head_dim", qk_nope_head_dim) + _positive_int("rope_dim", rope_dim)
        self.v_head_dim = _positive_int("v_head_dim", v_head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize == 1:
            raise ValueError(f"dtype: expected the queries' dtype (fp16, bf16 or fp32), got {dtype}")
        self.dtype = dtype
        per_block = (self.num_layers * self.block_size * self.num_heads * (self.key_dim + self.v_head_dim)
                     * dtype.itemsize)
        self.capacity = int(max_bytes) // per_block if isinstance(max_bytes, (int, np.integer)) else 0
        if self.capacity < 1:
            raise ValueError(f"max_bytes: expected at least one block's keys and values over every layer "
                             f"({per_block} bytes), got {max_bytes!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        shape = (self.num_layers, self.capacity, self.block_size, self.num_heads)
        self.k = torch.empty(*shape, self.key_dim, dtype=dtype, device=self.device)
        self.v = torch.empty(*shape, self.v_head_dim, dtype=dtype, device=self.device)
        self._slots: OrderedDict = OrderedDict()  # block id -> slot, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._written = np.zeros((self.num_layers, self.capacity), dtype=bool)  # a slot's block written, per layer
        self.step = 0

    def holds(self, block_ids) -> bool:
        """Whether every layer's keys and values of all ``block_ids`` are in the cache."""
        slots = [self._slots.get(int(b), -1) for b in block_ids]
        return min(slots, default=0) >= 0 and bool(self._written[:, slots].all())

    def assign(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Slots for one step's distinct prefix blocks ``block_ids`` (host, int64): ``(slots, missing)``, the
        blocks' slots and which of them the step's layers up-project (a block a layer has not written yet); None
        where they do not all fit (the step up-projects its prefixes as without a cache, and the cache is
        unchanged). Evicts the least recently used blocks the step does not hold. A new step: plans made before
        this one no longer run (:meth:`check_plan`)."""
        block_ids = np.asarray(block_ids, dtype=np.int64)
        if block_ids.size > self.capacity:
            return None
        self.step += 1
        wanted = set(block_ids.tolist())
        for b in block_ids.tolist():
            if b not in self._slots:
                if not self._free:
                    victim = next(v for v in self._slots if v not in wanted)  # fits: capacity >= len(wanted)
                    self._free.append(self._slots.pop(victim))
                slot = self._free.pop()
                self._written[:, slot] = False
                self._slots[b] = slot
            self._slots.move_to_end(b)
        slots = np.array([self._slots[b] for b in block_ids.tolist()], dtype=np.int64)
        return slots, ~self._written[:, slots].all(axis=0)

    def written(self, layer: int, slots: np.ndarray) -> None:
        """Record that ``layer`` wrote the keys and values of the blocks in ``slots`` (host, int64)."""
        self._written[layer, slots] = True

    def forget(self, block_ids=None) -> None:
        """Drop ``block_ids`` (every block where None): blocks an engine freed or rewrote. A plan made before runs
        no more (:meth:`check_plan`)."""
        dropped = list(self._slots) if block_ids is None else [int(b) for b in block_ids if int(b) in self._slots]
        for b in dropped:
            self._free.append(self._slots.pop(b))
        self.step += 1

    def check_plan(self, step: int, layer) -> None:
        """ValueError unless a plan made at ``step`` may run ``layer`` now: the cache's latest plan, a layer it
        has."""
        if step != self.step:
            raise ValueError(f"plan: made with this NaivePrefixCache before its latest plan or forget() (its step "
                             f"{step}, the cache's {self.step}): plan the step again")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}) (the cache's layers), got {layer!r}")
