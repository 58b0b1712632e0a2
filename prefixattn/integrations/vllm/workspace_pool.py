"""The metadata builders' workspaces, allocated while vLLM measures its memory, so the KV cache leaves room for them.

vLLM sizes the KV cache from what its profiling run leaves free (``gpu_worker.determine_available_memory``: a
forward with dummy inputs and no KV cache, then ``requested memory - non-KV memory``); metadata builders come later,
in ``initialize_kv_cache``. Workspaces allocated by the builders themselves (~0.4 GB per KV cache group at 8,192
tokens, 32 heads of 128) would come on top of ``--gpu-memory-utilization``. So the first forward without attention
metadata in a process with no builder yet (the profiling run; every attention layer gets ``attn_metadata=None``
there) allocates the workspaces of every builder vLLM will create, computed as vLLM will compute them: the KV cache
groups from the layers' cache specs (vLLM's own ``get_kv_cache_groups``), split into attention groups as vLLM splits
them (backend, layer spec, query heads), one builder per attention group and micro-batch, each with the geometry of
its layers. The builders then take these workspaces instead of allocating (a builder
created twice for CUDA-graph memory profiling takes them twice: once the first builder is gone they are free again).
A builder whose workspaces were not reserved (a configuration the profiling run did not foresee, or a platform that
runs no profiling forward, like vLLM's CPU build in eager mode) allocates its own and the log says so.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from prefixattn.integrations.vllm.layer_geometry import GroupGeometry, group_geometry, group_kv_dtype, group_layers
from prefixattn.integrations.vllm.wrappers import builder_wrappers, wrappers_device_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkspaceKey:
    """What makes two builders' workspaces interchangeable."""

    layer_names: tuple[str, ...]
    geometry: GroupGeometry
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device


@dataclass
class _Entry:
    key: WorkspaceKey
    wrappers: tuple
    #: the builder using the wrappers now (free when it is gone)
    owner: "weakref.ref | None" = field(default=None)

    def free(self) -> bool:
        return self.owner is None or self.owner() is None


def canonical_device(device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` are the same device here."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _cache_specs(vllm_config) -> dict:
    """``layer name -> KV cache spec`` as vLLM's model runner computes it (``get_kv_cache_spec``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    try:
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:  # not in every release: the spec as the layer declares it
        customize_attention_spec = None
    from vllm.v1.kv_cache_interface import AttentionSpec

    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
            continue  # shares another layer's cache: no spec of its own
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec and isinstance(spec, AttentionSpec) and customize_attention_spec is not None:
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if spec:
            specs[name] = spec
    return specs


def _num_builders_per_group(vllm_config) -> int:
    """vLLM makes one metadata builder per KV cache group and micro-batch."""
    pc = vllm_config.parallel_config
    return int(pc.num_ubatches) if getattr(pc, "use_ubatching", False) else 1


def _attention_groups(vllm_config, group) -> dict:
    """A KV cache group's layers split as vLLM splits them into attention groups (one metadata builder each): by
    backend, per-layer cache spec and query-head count (a draft model's layers get builders of their own)."""
    layers = group_layers(vllm_config, list(group.layer_names))
    split: dict = {}
    for name in group.layer_names:
        layer = layers.get(name)
        if layer is None:
            continue
        spec = group.kv_cache_spec
        spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)  # UniformTypeKVCacheSpecs: the layer's own
        split.setdefault((type(layer.impl), spec, getattr(layer, "num_heads", 0)), []).append(name)
    return split


def expected_builders(vllm_config, *, device, impl_cls: type) -> list[WorkspaceKey]:
    """One key per metadata builder of this backend vLLM will create for ``vllm_config``'s model: the attention
    groups whose layers' impl is an ``impl_cls`` (the backend passes its own; this module does not import it)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    keys = []
    q_dtype = vllm_config.model_config.dtype
    for group in get_kv_cache_groups(vllm_config, _cache_specs(vllm_config)):
        for (layer_impl, spec, _), names in _attention_groups(vllm_config, group).items():
            if not issubclass(layer_impl, impl_cls):
                continue  # another backend's layers
            key = WorkspaceKey(layer_names=tuple(sorted(names)), geometry=group_geometry(spec, vllm_config, names),
                               block_size=int(spec.block_size), q_dtype=q_dtype,
                               kv_dtype=group_kv_dtype(spec, vllm_config.cache_config.cache_dtype, q_dtype),
                               device=canonical_device(device))
            keys += [key] * _num_builders_per_group(vllm_config)
    return keys


class WorkspacePool:
    """Workspaces allocated for the builders of one vLLM config (one per process: one engine's worker)."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._config = None  # weakref to the config reserved for
        #: ids of the configs builders were created for (a forward without metadata after one reserves nothing)
        self._built_for: set[int] = set()
        #: device bytes of workspaces builders allocated themselves (not inside the memory profile)
        self.outside_bytes = 0

    def reserve(self, vllm_config, *, device, impl_cls: type) -> int:
        """Allocate every expected builder's workspaces (once per config, before any builder); returns the bytes
        allocated now. ``impl_cls``: the backend's impl class (:func:`expected_builders`)."""
        if id(vllm_config) in self._built_for or (self._config is not None and self._config() is vllm_config):
            return 0
        self._entries.clear()  # another engine's config in this process
        self._config = weakref.ref(vllm_config)
        # The profiling forward runs under inference mode; the workspaces are mutable runtime state, allocated as
        # normal tensors (as vLLM allocates its own persistent buffers).
        with torch.inference_mode(False):
            for key in expected_builders(vllm_config, device=device, impl_cls=impl_cls):
                wrappers = builder_wrappers(vllm_config, key.geometry, block_size=key.block_size,
                                            q_dtype=key.q_dtype, kv_dtype=key.kv_dtype, device=key.device)
                self._entries.append(_Entry(key=key, wrappers=wrappers))
        nbytes = self.reserved_bytes()
        if nbytes:
            logger.info("prefixattn: %.1f MiB of attention workspaces for %d metadata builders allocated inside "
                        "vLLM's memory profile", nbytes / 2 ** 20, len(self._entries))
        return nbytes

    def reserved_bytes(self) -> int:
        """Device bytes of the workspaces allocated in the memory profile."""
        return sum(wrappers_device_bytes(e.wrappers) for e in self._entries)

    def taken(self) -> int:
        """Reserved workspaces a live builder uses now."""
        return sum(not e.free() for e in self._entries)

    def note_outside(self, wrappers: tuple) -> None:
        """A builder allocated ``wrappers`` itself (after the memory profile)."""
        self.outside_bytes += wrappers_device_bytes(wrappers)

    def take(self, key: WorkspaceKey, owner, vllm_config) -> tuple | None:
        """The reserved wrappers for a builder with ``key`` of ``vllm_config`` (now owned by ``owner``), or None."""
        self._built_for.add(id(vllm_config))
        if self._config is None or self._config() is not vllm_config:
            return None
        for entry in self._entries:
            if entry.key == key and entry.free():
                entry.owner = weakref.ref(owner)
                return entry.wrappers
        if self._entries:
            logger.warning("prefixattn: a metadata builder for layers %s found no workspace reserved in vLLM's "
                           "memory profile (the profiling run foresaw %d others); it allocates its own",
                           list(key.layer_names)[:2], len(self._entries))
        return None


#: This process's pool.
POOL = WorkspacePool()
