"""What ``prefixattn compile-check`` reads out of a compiled kernel: pure functions of the compiler's text output.

The TTGIR's dots and their layouts (:func:`parse_dots`) and its KV loops' pipeline depth (:func:`parse_pipeline`),
the matrix instructions of the PTX or AMDGCN (:func:`count_matrix_instrs`), the Hopper features of sm_90 PTX
(:func:`hopper_features`), the ptxas ``-v`` log
(:func:`parse_ptxas`), the AMDGCN kernel descriptor (:func:`parse_amdgcn`) and its scratch-memory instructions
(:func:`count_private_memory_ops`). The module imports only ``re``: unit-testable on stored text.
:mod:`prefixattn.tuning.compile_check` compiles the kernels and applies these.
"""

from __future__ import annotations

import re

_DOT_RE = re.compile(r"=\s*(tt\.dot|ttng\.warp_group_dot)\s(.*)$")
_OPERAND_RE = re.compile(r"(?:tensor|!ttg\.memdesc)<(\d+)x(\d+)x(\w+)")
_RESULT_RE = re.compile(r"->\s*tensor<(\d+)x(\d+)x\w+,\s*(#[\w.]+)")
_ALIAS_RE = re.compile(r"^(#[\w.]+)\s*=\s*(.*)$", re.MULTILINE)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")


def parse_dots(ttgir: str) -> list[dict]:
    """Every dot of a TTGIR module: ``{"m", "k", "n", "dtype", "layout"}`` with layout ``mma_v2``, ``wgmma``,
    ``mfma``, ``wmma`` or ``fma`` (no matrix unit)."""
    aliases = dict(_ALIAS_RE.findall(ttgir))
    dots = []
    for line in ttgir.splitlines():
        m = _DOT_RE.search(line)
        if not m:
            continue
        ops = _OPERAND_RE.findall(m.group(2))
        res = _RESULT_RE.search(m.group(2))
        if len(ops) < 2 or res is None:
            continue
        (am, ak, adt), bn = ops[0], ops[1][1]
        enc = res.group(3)
        definition = aliases.get(enc, enc)
        if "nvidia_mma" in definition:
            v = re.search(r"versionMajor\s*=\s*(\d+)", definition)
            layout = "wgmma" if (m.group(1) == "ttng.warp_group_dot" or (v and int(v.group(1)) >= 3)) else "mma_v2"
        elif "amd_mfma" in definition:
            layout = "mfma"
        elif "amd_wmma" in definition:
            layout = "wmma"
        else:
            layout = "fma"
        dots.append({"m": int(am), "k": int(ak), "n": int(bn), "dtype": adt, "layout": layout})
    return dots


def count_matrix_instrs(asm: str, backend: str) -> dict:
    """Matrix instructions in PTX (``mma.sync``, ``wgmma.mma_async``) or AMDGCN (``v_mfma*``), by mnemonic."""
    pattern = r"\b(mma\.sync|wgmma\.mma_async)\b" if backend == "cuda" else r"\b(v_mfma\w*)"
    counts: dict[str, int] = {}
    for name in re.findall(pattern, asm):
        counts[name] = counts.get(name, 0) + 1
    return counts


#: The sm_90 PTX a Hopper-grade matrix class is made of: TMA loads (``cp.async.bulk.tensor``), register
#: reallocation between warp-specialized partitions (``setmaxnreg``), asynchronous warpgroup MMAs; and what a
#: portable binary uses instead, per-thread asynchronous copies (``cp.async.ca``/``cp.async.cg``).
_HOPPER_PTX = {"tma": re.compile(r"\bcp\.async\.bulk\.tensor\b"), "setmaxnreg": re.compile(r"\bsetmaxnreg\b"),
               "wgmma": re.compile(r"\bwgmma\.mma_async\b"), "cp_async": re.compile(r"\bcp\.async\.c[ag]\b")}
_WGMMA_WAIT = re.compile(r"\bwgmma\.wait_group(?:\.\w+)*\s+(\d+)\s*;")
#: Grid dependency control in PTX: a launch chained by PDL signals its dependents and waits for its predecessor.
_GRIDDEPCONTROL = {"launch_dependents": re.compile(r"\bgriddepcontrol\.launch_dependents\b"),
                   "wait": re.compile(r"\bgriddepcontrol\.wait\b")}


def pdl_features(ptx: str) -> dict:
    """Counts of ``griddepcontrol.launch_dependents`` and ``griddepcontrol.wait`` in PTX (programmatic dependent
    launch: :mod:`prefixattn.autotune.pdl`)."""
    return {name: len(pattern.findall(ptx)) for name, pattern in _GRIDDEPCONTROL.items()}


def hopper_features(ptx: str) -> dict:
    """Counts of the Hopper features in sm_90 PTX (``tma``, ``setmaxnreg``, ``wgmma``, ``cp_async``: see
    ``_HOPPER_PTX``) and ``wgmma_waits``, the distinct ``wgmma.wait_group`` depths (``[0]``: every warpgroup MMA
    is waited for before the next instruction needs it, so softmax never overlaps one)."""
    out = {name: len(pattern.findall(ptx)) for name, pattern in _HOPPER_PTX.items()}
    out["wgmma_waits"] = sorted({int(n) for n in _WGMMA_WAIT.findall(ptx)})
    return out


def parse_ptxas(log: str) -> dict:
    regs = _PTXAS_REGS.search(log)
    spill = _PTXAS_SPILL.search(log)
    stack = _PTXAS_STACK.search(log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": (int(spill.group(1)) + int(spill.group(2))) if spill else None,
            "stack_bytes": int(stack.group(1)) if stack else None}


def count_private_memory_ops(asm: str) -> int:
    """Instructions that touch scratch (private) memory: ``scratch_*`` (flat scratch) and buffer loads/stores through
    the private-segment resource (``s[0:3]`` or the registers it is copied to). Spilled registers go there.

    LLVM may reserve a private segment (``.private_segment_fixed_size``) for an emergency spill slot it never uses;
    counting the accesses tells a reserved slot from a real spill.
    """
    if not re.search(r"\.amdhsa_user_sgpr_private_segment_buffer\s+1", asm):
        # Architected flat scratch (gfx942+): s[0:3] is an ordinary register; spills use scratch_* instructions.
        return sum(1 for line in asm.splitlines() if line.strip().startswith("scratch_"))
    rsrc = {"s[0:3]"}
    lo = re.search(r"s_mov_b64 s\[(\d+):\d+\], s\[0:1\]", asm)
    hi = re.search(r"s_mov_b64 s\[(\d+):\d+\], s\[2:3\]", asm)
    if lo and hi and int(hi.group(1)) == int(lo.group(1)) + 2:
        rsrc.add(f"s[{lo.group(1)}:{int(lo.group(1)) + 3}]")
    count = 0
    for line in asm.splitlines():
        op = line.strip().split(" ", 1)
        if op[0].startswith("scratch_"):
            count += 1
        elif op[0].startswith("buffer_") and len(op) > 1:
            operands = [o.strip() for o in op[1].split(",")]
            # A spill slot is addressed by immediate offset alone (vaddr "off"); ordinary buffer accesses (Triton's
            # buffer ops, which may reuse s[0:3] once the private resource moved) carry a VGPR offset.
            if len(operands) >= 3 and operands[1] == "off" and operands[2] in rsrc:
                count += 1
    return count


def parse_amdgcn(asm: str) -> dict:
    def field(name):
        m = re.search(rf"^[\s-]*\.{name}:\s*(\d+)", asm, re.MULTILINE)
        return int(m.group(1)) if m else None

    vgpr, agpr = field("vgpr_count"), field("agpr_count")
    return {"registers": vgpr, "agprs": agpr, "sgprs": field("sgpr_count"),
            "vgpr_spills": field("vgpr_spill_count"), "sgpr_spills": field("sgpr_spill_count"),
            "scratch_bytes": field("private_segment_fixed_size"), "lds_bytes": field("group_segment_fixed_size")}


_FOR_RE = re.compile(r"\bscf\.for\b")
_WAIT_RE = re.compile(r"ttg\.async_wait\b.*\{num = (\d+)")
_BUFFER_RE = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+)x(\d+)x\w+[^>]*mutable")
_DEF_RE = re.compile(r"^(%[\w.#:]+?)(?::\d+)?\s*=\s*([\w.]+)\s+(%[\w.#]+)")
_TILE_LOAD_RE = re.compile(r"^(%[\w.]+)\s*=\s*(?:tt\.load|amdgpu\.buffer_load|amdg\.buffer_load)\b.*:\s*"
                           r"(?:tensor<\d+x\d+x|!tt\.ptr<)")
_LOCAL_STORE_RE = re.compile(r"ttg\.local_store\s+(%[\w.]+),")


def _loop_bodies(ttgir: str) -> tuple[list[list[str]], list[int]]:
    """The op lines of every ``scf.for`` body (nested loops' lines belong to the innermost loop only) and each loop's
    enclosing loop (its index, -1 at the top)."""
    stack: list = []  # one entry per open region: the index of the loop collecting its lines, or None
    bodies, parents = [], []
    for raw in ttgir.splitlines():
        line = raw.strip()
        if line.startswith("}"):
            if stack:
                stack.pop()
            if line.endswith("{"):  # "} else {"
                stack.append(None)
            continue
        loop = next((b for b in reversed(stack) if b is not None), None)
        if loop is not None:
            bodies[loop].append(line)
        if line.endswith("{") and not line.startswith("#"):
            if _FOR_RE.search(line):
                parents.append(-1 if loop is None else loop)
                bodies.append([])
                stack.append(len(bodies) - 1)
            else:
                stack.append(None)
    return bodies, parents


def _stored_from_load(body: list[str]) -> bool:
    """Whether a ``ttg.local_store`` of this loop writes a tile the same loop loaded from global memory (through
    at most a few single-operand conversions): the stream pipeliner's register prefetch on AMD."""
    defs = {}
    loads = set()
    for line in body:
        m = _TILE_LOAD_RE.match(line)
        if m:
            loads.add(m.group(1))
            continue
        d = _DEF_RE.match(line)
        if d:
            defs[d.group(1)] = d.group(3)
    for line in body:
        m = _LOCAL_STORE_RE.search(line)
        value = m.group(1) if m else None
        for _ in range(4):
            if value is None or value in loads:
                break
            value = defs.get(value)
        if value in loads:
            return True
    return False


def parse_pipeline(ttgir: str) -> dict:
    """Pipeline depth of the KV loops of a TTGIR module: K/V tiles in flight per program.

    * ``kv_buffers``: leading dimension of every multi-buffered shared-memory tile (``local_alloc`` of rank 3,
      mutable): the copies of each K/V tile the loop rotates through.
    * ``waits``: the ``num`` of every ``ttg.async_wait`` inside a loop (commit groups left in flight);
      ``groups_per_iter``: ``ttg.async_commit_group`` per iteration of those loops (K and V: 2).
    * ``prefetch``: a loop stores to shared memory (LDS) a tile it loaded from global memory in the same iteration
      (AMD's stream pipeliner: the next tile's loads are issued before this tile's dots).
    * ``depth``: tiles in flight when a KV loop waits, the smallest over its loops: ``1 + num // groups_per_iter``
      with asynchronous copies (the tile waited for plus those left in flight), capped by ``kv_buffers``; with a
      register prefetch, ``kv_buffers + 1``; 1 for a loop that loads K/V and waits for each tile; None when no loop
      stages tiles in shared memory (nothing to pipeline, e.g. the merge kernels). A loop around a loop that stages
      tiles (a persistent loop over work items) is not a KV loop: the copies and the drain wait of the pipeline's
      prologue and epilogue that sit in its body would read as a loop waiting for every tile.
    """
    buffers = [int(m.group(1)) for m in _BUFFER_RE.finditer(ttgir)]
    bodies, parents = _loop_bodies(ttgir)
    staged = {}  # loop index -> (waits, commit groups per iteration, depth, register prefetch)
    for i, body in enumerate(bodies):
        nums = [int(m.group(1)) for line in body for m in [_WAIT_RE.search(line)] if m]
        commits = sum("ttg.async_commit_group" in line for line in body)
        if nums and commits:
            depth = 1 + min(nums) // commits
            staged[i] = (nums, commits, min(depth, min(buffers)) if buffers else depth, False)
        elif _stored_from_load(body):
            staged[i] = ([], 0, min(buffers) + 1 if buffers else 1, True)
        elif any("ttg.local_store" in line or "ttg.async_copy_global_to_local" in line for line in body):
            staged[i] = ([], 0, 1, False)
    outer = set()  # every loop around a staging loop
    for i in staged:
        while parents[i] >= 0:
            i = parents[i]
            outer.add(i)
    kv = [v for i, v in staged.items() if i not in outer]
    return {"kv_buffers": buffers, "waits": [n for nums, *_ in kv for n in nums],
            "groups_per_iter": [c for _, c, _, _ in kv if c], "prefetch": any(p for *_, p in kv),
            "depth": min(d for _, _, d, _ in kv) if kv else None}
