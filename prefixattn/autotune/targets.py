"""GPU targets the kernels are tuned and compile-checked for: resource limits, knobs and nominal speeds.

One row per compiler target (an SM version or a gfx ISA), filled with the numbers of the product users run on it
(A100/H100/H200 for sm80/sm90, MI250X/MI300X/MI355X for gfx90a/gfx942/gfx950). Limits are what one program
(thread block / workgroup) may use; speeds are datasheet peaks for the analytic cost model only.

Nothing here imports torch or triton: :func:`detect_target` imports torch lazily, and the compile-check builds
``triton.backends.compiler.GPUTarget`` from :attr:`Target.backend`, :attr:`Target.arch` and :attr:`Target.warp_size`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Registers one NVIDIA thread may address (PTX/SASS encodes 8-bit register numbers, R255 is the zero register).
_NV_MAX_REGS_PER_THREAD = 255
#: The 32-bit register file of one SM on every NVIDIA generation since Volta.
_NV_REGS_PER_SM = 65536
#: CDNA2/CDNA3 SIMDs hold 512 VGPRs per lane, shared by architectural VGPRs and accumulation (AGPR) registers; one
#: wave may address all 512 (256 arch + 256 acc).
_CDNA_VGPRS_PER_LANE = 512
#: Waves one CDNA SIMD keeps resident (occupancy ceiling), and SIMDs per CU.
_CDNA_MAX_WAVES_PER_SIMD = 8
_CDNA_SIMDS_PER_CU = 4


@dataclass(frozen=True)
class Target:
    """One compiler target and the limits one program must fit in.

    Attributes
    ----------
    name : short name used everywhere (``"sm90"``, ``"gfx942"``): CLI flags, JSON file names, cache keys.
    backend : ``"cuda"`` or ``"hip"`` (Triton's backend names).
    arch : Triton's arch value: compute capability ``int`` (``90``) or gfx ISA ``str`` (``"gfx942"``).
    warp_size : threads per warp (32) or wavefront (64 on CDNA).
    num_sms : SMs (NVIDIA) or CUs (AMD, per GCD on MI250X) of the reference product.
    max_shared_bytes : shared memory (LDS) one program may allocate (the opt-in maximum on NVIDIA).
    max_regs_per_thread : registers one thread may use before the compiler must spill.
    regs_per_sm : 32-bit registers per SM/CU available to resident programs (occupancy).
    max_threads_per_sm : resident threads per SM/CU.
    max_programs_per_sm : resident programs (blocks/workgroups) per SM/CU.
    mem_bw_gbs : HBM bandwidth in GB/s (datasheet), for the cost model.
    matmul_tflops : dense fp16/bf16 matrix peak in TFLOP/s with fp32 accumulation (datasheet), for the cost model.
    fp32_tflops : fp32 peak of the path an exact (``input_precision="ieee"``) fp32 dot takes: CUDA cores on NVIDIA,
        fp32 MFMA on CDNA (datasheet).
    shared_per_sm : shared memory (LDS) per SM/CU shared by resident programs (occupancy).
    products : product names (substrings of the device name) that map to this row.
    matrix_instrs : assembly mnemonics (prefixes) that prove the matrix units are used.
    hip_knobs : compile options only HIP takes, with the values worth tuning (empty on CUDA).
    stage_semantics : how ``num_stages`` maps onto shared-memory buffers on this backend.
    """

    name: str
    backend: str
    arch: int | str
    warp_size: int
    num_sms: int
    max_shared_bytes: int
    max_regs_per_thread: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_programs_per_sm: int
    mem_bw_gbs: float
    matmul_tflops: float
    fp32_tflops: float
    shared_per_sm: int
    products: tuple[str, ...]
    matrix_instrs: tuple[str, ...]
    hip_knobs: dict = field(default_factory=dict)
    stage_semantics: str = ""
    async_copy: bool = False

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"

    @property
    def default_num_stages(self) -> int:
        """Triton's ``num_stages`` when a launch passes none (CUDAOptions: 3, HIPOptions: 2)."""
        return 2 if self.is_hip else 3

    def smem_buffers(self, num_stages: int) -> int:
        """Copies of each pipelined K/V tile kept in shared memory for ``num_stages``.

        CUDA's software pipeliner keeps one buffer per stage (cp.async / TMA ring). HIP's stream pipeliner issues the
        next iteration's global loads into registers and writes them to LDS one iteration later, so ``num_stages=2``
        needs a single LDS buffer and each further stage adds one; gfx950 copies global -> LDS asynchronously
        (Triton enables it there), which needs a buffer per stage like CUDA.
        """
        if self.is_hip and not self.async_copy:
            return max(1, num_stages - 1)
        return max(1, num_stages)


_NV_MATRIX = ("mma.sync", "wgmma.mma_async")
_NV_STAGES = "num_stages = shared-memory buffers per pipelined tile (cp.async/TMA ring); 2-4 useful"
_HIP_STAGES = ("num_stages 2 = stream pipeliner prefetching through registers into one LDS buffer; 1 = no "
               "pipelining; more stages add LDS buffers (rarely pays off for attention)")
#: 0 means "let the compiler choose" for waves_per_eu and matrix_instr_nonkdim (Triton's defaults).
_CDNA_KNOBS = {"waves_per_eu": (0, 1, 2, 4), "matrix_instr_nonkdim": (0, 16, 32), "kpack": (1, 2)}


def _nv(name, cc, sms, smem, smem_sm, threads, programs, bw, tflops, fp32, products):
    return Target(name=name, backend="cuda", arch=cc, warp_size=32, num_sms=sms, max_shared_bytes=smem,
                  max_regs_per_thread=_NV_MAX_REGS_PER_THREAD, regs_per_sm=_NV_REGS_PER_SM,
                  max_threads_per_sm=threads, max_programs_per_sm=programs, mem_bw_gbs=bw, matmul_tflops=tflops,
                  fp32_tflops=fp32, shared_per_sm=smem_sm, products=products, matrix_instrs=_NV_MATRIX,
                  stage_semantics=_NV_STAGES)


def _cdna(name, cus, lds, bw, tflops, fp32, products, knobs, async_copy=False):
    return Target(name=name, backend="hip", arch=name, warp_size=64, num_sms=cus, max_shared_bytes=lds,
                  max_regs_per_thread=_CDNA_VGPRS_PER_LANE,
                  regs_per_sm=_CDNA_VGPRS_PER_LANE * 64 * _CDNA_SIMDS_PER_CU,
                  max_threads_per_sm=_CDNA_MAX_WAVES_PER_SIMD * _CDNA_SIMDS_PER_CU * 64, max_programs_per_sm=32,
                  mem_bw_gbs=bw, matmul_tflops=tflops, fp32_tflops=fp32, shared_per_sm=lds, products=products,
                  matrix_instrs=("v_mfma",), hip_knobs=knobs, stage_semantics=_HIP_STAGES, async_copy=async_copy)


#: Every target, by name. Shared memory per program (per SM): A100 163 KiB (164), L40S 99 KiB (100), H100/H200
#: 227 KiB (228) as opt-in maxima; LDS 64 KiB per CU on CDNA2/3 and 160 KiB on CDNA4. Speeds: A100 SXM 80GB, L40S,
#: H100 SXM, one MI250X GCD (half the card), MI300X, MI355X. gfx950 deprecates kpack: Triton rewrites anything but 1.
TARGETS: dict[str, Target] = {t.name: t for t in (
    _nv("sm80", 80, 108, 166912, 167936, 2048, 32, 2039.0, 312.0, 19.5, ("A100", "A800", "A30")),
    _nv("sm89", 89, 142, 101376, 102400, 1536, 24, 864.0, 362.0, 91.6, ("L40S", "L40", "RTX 4090", "L4")),
    _nv("sm90", 90, 132, 232448, 233472, 2048, 32, 3350.0, 989.0, 67.0, ("H100", "H200", "H800", "H20")),
    _cdna("gfx90a", 110, 65536, 1638.0, 191.5, 47.9, ("MI250", "MI210"), _CDNA_KNOBS),
    _cdna("gfx942", 304, 65536, 5300.0, 1307.0, 163.4, ("MI300X", "MI300A", "MI325X"), _CDNA_KNOBS),
    _cdna("gfx950", 256, 163840, 8000.0, 2516.0, 157.3, ("MI355X", "MI350X"), {**_CDNA_KNOBS, "kpack": (1,)},
          async_copy=True),
)}

#: The targets CI compile-checks by default (the ones users run: A100, H100/H200, MI250, MI300X).
DEFAULT_CHECK_TARGETS = ("sm80", "sm90", "gfx90a", "gfx942")


def get_target(name: str) -> Target:
    """The :class:`Target` called ``name``; ValueError naming the known ones otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {name!r}") from None


def parse_targets(spec: str) -> list[Target]:
    """``"sm80,gfx942"`` -> targets, in the order given (duplicates dropped)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"targets: expected a comma-separated list of {', '.join(TARGETS)}, got {spec!r}")
    return [get_target(n) for n in dict.fromkeys(names)]


def gfx_isa(gcn_arch: str) -> str:
    """The gfx ISA of a HIP ``gcnArchName``, its feature suffix dropped (``"gfx942:sramecc+:xnack-"``: ``"gfx942"``)."""
    return gcn_arch.split(":")[0].strip()


def target_for(capability: tuple[int, int] | None = None, gcn_arch: str | None = None) -> Target | None:
    """The table row for a CUDA compute capability or a HIP ``gcnArchName`` (``"gfx942:sramecc+:xnack-"``).

    Returns None for a device the table does not know (the caller falls back to the heuristic).
    """
    if gcn_arch:
        return TARGETS.get(gfx_isa(gcn_arch))
    if capability:
        return TARGETS.get(f"sm{capability[0]}{capability[1]}")
    return None


def detect_target() -> Target | None:
    """The target of the current torch device, or None (no GPU, the interpreter, or a device not in the table)."""
    from prefixattn.runtime import interpreter_enabled

    if interpreter_enabled():
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; kept for a bare triton install
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gcn = getattr(props, "gcnArchName", None) if getattr(torch.version, "hip", None) else None
    return target_for(capability=(props.major, props.minor), gcn_arch=gcn)


#: gfx ISAs whose merge counters Triton turns into buffer atomics (CDNA3 and CDNA4; gfx90a keeps global atomics).
#: Their agent-scope fences are ``buffer_wbl2 sc1`` (release: the XCD's L2 written back) and ``buffer_inv sc1``
#: (acquire: invalidated), as in LLVM's AMDGPU memory model for gfx942 and gfx950.
BUFFER_ATOMIC_ARCHS = ("gfx942", "gfx950")
#: The first Triton release whose buffer atomics carry their fences the right way round. Before it (3.6 and 3.8 in
#: compile-check; triton-lang/triton#11081) a release atomic gets the acquire's invalidate after it and an acquire
#: atomic the release's write-back before it: the in-launch merge could read partial states older than its reports.
FENCED_BUFFER_ATOMICS_SINCE = (3, 9)


def writes_own_l2_fences(arch: int | str, triton_version: str | None = None) -> bool:
    """Whether the fused kernel writes its merge's release and acquire fences itself (its ``USE_L2_FENCES``): on
    ``arch`` (a gfx ISA; a CUDA compute capability never) under a Triton (``triton_version``, default the installed
    one, imported lazily) that misplaces the fences of buffer atomics."""
    if arch not in BUFFER_ATOMIC_ARCHS:
        return False
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    found = re.match(r"(\d+)\.(\d+)", triton_version)
    if found is None:
        raise ValueError(f"triton_version: expected 'MAJOR.MINOR[...]', got {triton_version!r}")
    return (int(found[1]), int(found[2])) < FENCED_BUFFER_ATOMICS_SINCE
