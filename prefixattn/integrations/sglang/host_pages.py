"""Host-side page labels the SGLang backend plans with, read from the radix cache instead of the device.

The planner finds shared prefixes from identical leading ids in a host block table; the kernel reads the physical
page ids from a device table gathered from ``req_to_token`` (never from the host table). So the host table only has
to say *which pages two requests share*, not which physical pages they are. SGLang 0.5.23 keeps no host copy of
``req_to_token`` (slot ids come from its device-side allocator), but its scheduler knows on the host which part of
every request's row is the radix cache's:

* ``req.kv.cache_protected_len`` (``schedule_batch.py`` ``ReqKvInfo``): the tree owns ``[0, cache_protected_len)``
  of the row, and ``req.last_node`` ends the tree path those slots were copied from: at admission
  ``alloc_for_extend`` writes ``row[:prefix_len]`` from ``tree_cache.prefix_device_indices(req)`` (the path's
  values), and every ``checkpoint`` rewrites ``row[cache_protected_len:len(path)]`` from the new path before it
  moves ``last_node`` and ``cache_protected_len`` (``unified_radix_cache.py`` ``checkpoint_into_tree``,
  ``radix_cache.py`` ``checkpoint``); nothing rewrites ``row[:cache_protected_len]`` while the request holds its row.
* The path's nodes are locked while the request runs, so their values (slot ids) stay; a split keeps the values.

A page is labelled ``(tree node, page within the node)`` when it lies inside both ``cache_protected_len`` and the
path (a node whose device value is absent or not as long as its key ends the trusted part), else with a label of
its own. Equal labels are equal slots; a prefix the host cannot vouch for only loses sharing. Labels are numbered
densely from 0 per step. Paths come from ``tree_core.collect_path_info`` (``UnifiedRadixCache``, SGLang's default:
one native call per batch) or a walk of ``TreeNode.parent`` (the legacy ``RadixCache``).

The scheduler state is captured when SGLang builds the batch: :func:`install_tap` wraps ``ForwardBatch.init_new``
and records the batch's requests; :class:`HostPages` finds the record of the batch it is given (the ForwardBatch
itself or a CUDA-graph replay view of it). Under the overlap scheduler ``run_batch`` builds the ForwardBatch and
plans it before the previous batch's results are processed, and the forward stream waits for the scheduling
stream's row writes; later writes wait for the forward's reads (the scheduler's WAR barrier), which end in the
backend's own device gather. Where no record or tree applies, the backend copies the rows from the device.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchRecord:
    """What the scheduler knew of a ForwardBatch's requests when it was built."""

    batch: "weakref.ref"  # the ForwardBatch
    out_cache_loc: object  # its out_cache_loc tensor: a replay view of the batch carries the same object
    rows: tuple  # per request: (req_pool_idx, cache_protected_len, last_node)
    tree_cache: object


#: The latest ForwardBatch built in this process (SGLang plans a batch in the same run_batch that built it).
_LATEST: list = [None]


def record_batch(forward_batch, schedule_batch) -> None:
    """Record ``schedule_batch``'s requests for ``forward_batch`` (the tap calls this after ``init_new``)."""
    _LATEST[0] = None
    try:
        rows = tuple((r.kv.req_pool_idx, int(r.kv.cache_protected_len), r.last_node) for r in schedule_batch.reqs)
    except (AttributeError, TypeError):  # requests without that state: no record (the backend copies the rows)
        return
    _LATEST[0] = BatchRecord(batch=weakref.ref(forward_batch), out_cache_loc=forward_batch.out_cache_loc, rows=rows,
                             tree_cache=getattr(schedule_batch, "tree_cache", None))


def tapped_init_new(init_new):
    """``ForwardBatch.init_new`` that also records the batch's requests (:func:`record_batch`)."""

    @functools.wraps(init_new)
    def wrapper(cls, batch, model_runner, *args, **kwargs):
        ret = init_new(cls, batch, model_runner, *args, **kwargs)
        record_batch(ret, batch)
        return ret

    wrapper._prefixattn_tap = True
    return classmethod(wrapper)


def install_tap() -> None:
    """Wrap ``ForwardBatch.init_new`` once per process (idempotent); SGLang's behaviour is unchanged."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    current = ForwardBatch.__dict__["init_new"]
    if getattr(current.__func__, "_prefixattn_tap", False):
        return
    ForwardBatch.init_new = tapped_init_new(current.__func__)


def _record_for(forward_batch) -> BatchRecord | None:
    rec = _LATEST[0]
    if rec is None:
        return None
    built = rec.batch()
    if built is forward_batch:
        return rec
    # A decode graph's replay view: a namespace over the padded buffers with the batch's own out_cache_loc.
    loc = getattr(forward_batch, "out_cache_loc", None)
    return rec if built is not None and loc is not None and loc is rec.out_cache_loc else None


# ---------------------------------------------------------------------------------------------------------------
# Tree paths: per request, (node key, path_start, path_end) of the trusted nodes, root first
# ---------------------------------------------------------------------------------------------------------------

def _paths_native(tree_core, nodes: list) -> list:
    """``collect_path_info`` for the requests whose ``last_node`` is a NodeId (one call; per request on a miss)."""
    handles = [n if isinstance(n, (int, np.integer)) and not isinstance(n, bool) else None for n in nodes]
    wanted = [h for h in handles if h is not None]
    try:
        found = iter(tree_core.collect_path_info(wanted)) if wanted else iter(())
        infos = [next(found) if h is not None else () for h in handles]
    except KeyError:  # a handle the tree no longer has: that request alone goes unlabelled
        infos = []
        for h in handles:
            try:
                infos.append(tree_core.collect_path_info([h])[0] if h is not None else ())
            except KeyError:
                infos.append(())
    return [[(("n", i.node_id), i.path_start, i.path_end) for i in _with_values(info)] for info in infos]


def _with_values(info) -> list:
    """The leading nodes of a path whose device value is as long as their key (a missing value ends the trust)."""
    out = []
    for i in info:
        if i.full_value_len is None or i.full_value_len != i.path_end - i.path_start:
            break
        out.append(i)
    return out


def _paths_tree_nodes(root, nodes: list) -> list:
    """The legacy ``RadixCache``: walk ``TreeNode.parent`` to the root (key lengths are host data)."""
    paths = []
    for node in nodes:
        chain = []
        while node is not None and node is not root and getattr(node, "parent", None) is not None:
            chain.append(node)
            node = node.parent
        if node is not root:  # not a node of this tree (None, a session sentinel): nothing trusted
            paths.append([])
            continue
        path, start = [], 0
        for n in reversed(chain):
            value = n.value
            if value is None or len(value) != len(n.key):
                break
            path.append((("t", id(n)), start, start + len(n.key)))
            start += len(n.key)
        paths.append(path)
    return paths


def tree_paths(tree_cache, nodes: list) -> list | None:
    """Per request, its trusted path nodes ``(key, start, end)`` root first; None for a cache without a tree."""
    core = getattr(tree_cache, "tree_core", None)
    if core is not None and hasattr(core, "collect_path_info"):
        return _paths_native(core, nodes)
    root = getattr(tree_cache, "root_node", None)
    if root is not None and hasattr(root, "children"):
        return _paths_tree_nodes(root, nodes)
    return None


# ---------------------------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------------------------

def page_labels(paths: list, protected: list[int], used_pages: np.ndarray, *, page_size: int, width: int,
                rows: int) -> np.ndarray:
    """``[rows, width]`` int32 labels: the trusted tree pages by node, every other used page its own.

    Parameters
    ----------
    paths : list
        Per request (the first ``len(paths)`` rows), its trusted path nodes ``(key, start, end)`` in tokens.
    protected : list of int
        Per request, ``cache_protected_len``: the tree-owned prefix of its row.
    used_pages : ndarray, ``[rows]``
        Pages each row uses (rows past ``len(paths)``: padding, labelled on their own).
    page_size, width, rows : int
    """
    out = np.zeros((rows, width), dtype=np.int32)
    bases: dict = {}
    nxt = 0
    for r in range(rows):
        used = min(int(used_pages[r]), width)
        shared = 0
        if r < len(paths):
            limit = min(protected[r], used * page_size)
            for key, start, end in paths[r]:
                if start % page_size or start >= limit:
                    break
                stop = min(end, limit) // page_size  # whole pages only
                first = start // page_size
                if stop <= first:
                    break
                base = bases.get(key)
                if base is None:  # the whole node's pages, so every request through it agrees
                    base = bases[key] = nxt - first
                    nxt += -(-(end - start) // page_size)
                out[r, first:stop] = np.arange(base + first, base + stop, dtype=np.int32)
                shared = stop
                if stop * page_size < min(end, limit):
                    break
        out[r, shared:used] = np.arange(nxt, nxt + used - shared, dtype=np.int32)
        nxt += used - shared
    return out


class HostPages:
    """One backend's source of host page labels (:func:`page_labels`) for the batches SGLang builds."""

    def __init__(self) -> None:
        install_tap()

    @staticmethod
    def labels(forward_batch, *, bs: int, kv_lens: np.ndarray, page_size: int, width: int, num_pages: int,
               unshared: bool = False, live: int | None = None) -> np.ndarray | None:
        """``[bs, width]`` labels for ``forward_batch`` (padded rows of a replay view included), or None when no
        record of it, or no tree, is there to vouch for shared pages, or the labels would not fit below
        ``num_pages`` (the pool's page count, which plans check ids against). ``unshared``: every page its own
        label. ``live``: the requests before the padding rows (default: ``bs`` less the batch's ``num_padding``, a
        decode graph's count; a prefill graph's view has sentinel slots instead)."""
        used = -(-np.asarray(kv_lens, dtype=np.int64) // page_size)
        if unshared:
            out = page_labels([], [], used, page_size=page_size, width=width, rows=bs)
            return out if int(used.sum()) <= num_pages else None
        rec = _record_for(forward_batch)
        if rec is None:
            return None
        real = live if live is not None else bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        if len(rec.rows) != real:
            return None
        pool_rows = getattr(forward_batch, "req_pool_indices_cpu", None)  # extend batches: the rows, on the host
        if pool_rows is not None and list(map(int, pool_rows[:real])) != [row for row, _, _ in rec.rows]:
            return None
        paths = tree_paths(rec.tree_cache, [node for _, _, node in rec.rows])
        if paths is None:
            return None
        out = page_labels(paths, [p for _, p, _ in rec.rows], used, page_size=page_size, width=width, rows=bs)
        # Distinct tree pages and request-owned pages are distinct pool pages, so this holds but for pages the
        # host could not vouch for (labelled twice) and padding rows.
        return out if out.size == 0 or int(out.max()) < num_pages else None
