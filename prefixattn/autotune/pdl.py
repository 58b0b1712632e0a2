"""Whether a plan's work-class launches chain by programmatic dependent launch (PDL, sm_90 and newer): asked for
(``PREFIXATTN_PDL=1``), and where it is served (:func:`pdl_choice`), decided here and nowhere else, reported in
``Plan.stats`` (``pdl``, ``pdl_why``).

In series, a step's launches (shared, chunk, decode: one per work class) each wait for the one before to complete:
the SMs its last wave leaves stay idle until it drains, and the next launch starts after a gap. Under PDL every
program of a launch signals at its start that the next launch may begin (``griddepcontrol.launch_dependents``), and
the launches after the first are launched as its dependents: the next class's programs are placed on the SMs as the
previous class's programs leave them. No program waits on another (the merge's last arriver merges a row, whichever
launch makes it), so nothing else changes but one rule: what follows the step on the stream waits only for its last
launch, so the last program of every launch first waits for the launch before it to complete
(``griddepcontrol.wait``), and the step's last launch completes after all of them. Its inputs (q, the caches, the
plan's tables) were written before the step's first launch began, so a dependent launch reads them without waiting.

A plan that chains its launches prices its sharing candidates so and reports the step's modeled time chained
(``stats["modeled_pdl_us"]``: :func:`prefixattn.planner.stats.chained_us`, modeled). The Hopper build
(:mod:`prefixattn.autotune.builds`) has no PDL: its launch starts after the one before completes and
its own dependents start when it completes, as in series. Off by default until the GPU check has measured it (the
``prefixattn-pdl`` provider), and never in Triton's interpreter, on AMD or before sm_90.

No torch or triton import here: the planner and the compile-check share it.
"""

from __future__ import annotations

from prefixattn.autotune.env_switch import EnvSwitch

#: The environment variable that asks for PDL: ``1`` (on) or ``0`` (off, the default).
PDL_ENV = "PREFIXATTN_PDL"
#: The first NVIDIA architecture with grid dependency control (``griddepcontrol``).
PDL_MIN_ARCH = 90

#: ``PREFIXATTN_PDL``, read once per process (:class:`~prefixattn.autotune.env_switch.EnvSwitch`).
_switch = EnvSwitch(PDL_ENV, {"0": False, "1": True}, "0", "asking_for_pdl")


def requested_pdl() -> bool:
    """Whether PDL is asked for: the innermost :func:`asking_for_pdl`, else ``PREFIXATTN_PDL`` (``0`` or ``1``;
    default ``0``), read once per process. ``ValueError`` naming the variable for another value."""
    return _switch.requested()


def asking_for_pdl(on: bool):
    """Plans made inside ask for PDL (``on``) or not, whatever the environment says (the GPU check times both in one
    process; tests): a context manager."""
    return _switch.asking_for(on)


def pdl_refusal(*, is_hip: bool, arch, interpreted: bool) -> str | None:
    """Why a plan's launches on this device cannot chain by PDL (None: they can). ``arch``: the compute capability
    as an int (``90``), the gfx ISA, or None off a GPU; ``interpreted``: the kernels run in Triton's interpreter."""
    if interpreted:
        return "the kernels run in Triton's interpreter, which has no grid dependency control"
    if is_hip or not isinstance(arch, int) or arch < PDL_MIN_ARCH:
        return f"NVIDIA sm_{PDL_MIN_ARCH} and newer only (griddepcontrol), not {arch}"
    return None


def pdl_choice(requested: bool, **device) -> tuple[bool, str]:
    """``(on, why)``: whether a plan's launches chain by PDL, and why. ``requested``: :func:`requested_pdl`'s;
    ``device``: :func:`pdl_refusal`'s arguments."""
    if not requested:
        return False, f"the default ({PDL_ENV}=1 asks for it)"
    refusal = pdl_refusal(**device)
    if refusal is not None:
        return False, f"PDL serves {refusal}"
    return True, f"asked for ({PDL_ENV}=1), and this device serves it"
