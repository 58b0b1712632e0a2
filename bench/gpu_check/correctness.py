"""The GPU check's correctness step: every kernel variant of :func:`gpu_check.cases.correctness_cases` against the
fp64 reference, with NaN-poisoned outputs and padding rows, :data:`REPEATS` runs bit-identical; the sanitizer's cases
(:mod:`gpu_check.sanitizer`) run first. Torch and prefixattn are imported inside the functions: the driver sets
``TRITON_INTERPRET`` (``--dry-run``) before anything imports them. Public prefixattn API only.
"""

from __future__ import annotations

from gpu_check.clock import Clock, guarded

REPEATS = 3  # runs of each correctness case whose outputs must be bit-identical


def _bits(t):
    import torch

    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_case(case, scale: int, device: str, seed: int, build: str = "portable",
               features: dict | None = None, pdl: bool = False) -> dict | None:
    """One correctness case: NaN-poisoned out and q padding, REPEATS runs bit-identical, fp64 reference. ``build``:
    the build the plan asks for (``prefixattn.autotune.builds``); None where no class of the plan takes it (no
    shared or chunk class, or shapes it does not serve). ``features``: ``window_left``/``logits_soft_cap`` (plan
    options) and ``sinks`` (True: a random logit per query head), applied to the reference too. ``pdl``: the plan
    asks for launches chained by PDL (``prefixattn.autotune.pdl``); None where it has fewer than two launches or
    does not chain them."""
    import torch

    import prefixattn
    from gpu_check.cases import PAD_ROWS, build_case
    from prefixattn.autotune.builds import asking_for
    from prefixattn.autotune.pdl import asking_for_pdl
    from tests.tolerances import ATTENTION_TOL, LSE_TOL

    b, options = build_case(case, scale, seed)
    q, k, v = (t.to(device) for t in (b.q, b.k_cache, b.v_cache))
    meta = tuple(t.to(device) for t in b.metadata)
    features = features or {}
    model = {name: value for name, value in features.items() if name != "sinks"}
    calls = {}  # attention()'s and the reference's own arguments
    if features.get("sinks"):
        calls["sinks"] = torch.randn(b.heads["num_qo_heads"], generator=torch.Generator().manual_seed(seed)).to(device)
    with asking_for(build), asking_for_pdl(pdl):
        p = prefixattn.plan(*meta, **b.heads, q_dtype=case.dtype, **options, **model)
    if build != "portable" and build not in map(p.build_of, p.work_classes):
        return None
    if pdl and (not p.pdl or p.num_launches < 2):
        return None
    n = p.num_tokens
    q = torch.cat([q, torch.full((PAD_ROWS, *q.shape[1:]), float("nan"), dtype=q.dtype, device=device)])
    outs = []
    for _ in range(REPEATS):
        out = torch.full_like(q, float("nan"))
        got, lse = prefixattn.attention(q, k, v, p, out=out, return_lse=True, **calls)
        outs.append((got.clone(), lse.clone()))
    want, want_lse = prefixattn.reference_attention(q[:n], k, v, *meta, return_lse=True, compute_dtype=torch.float64,
                                                    **model, **calls)
    got, lse = outs[0]
    atol, rtol = ATTENTION_TOL[case.dtype]
    err = (got[:n].double() - want).abs()
    lse_err = (lse[:n].double() - want_lse).abs().nan_to_num(0.0)  # -inf == -inf rows (no visible KV) give NaN
    ok_out = bool(torch.isfinite(got[:n]).all() and (err <= atol + rtol * want.abs()).all())
    ok_lse = bool((lse_err <= LSE_TOL[0] + LSE_TOL[1] * want_lse.abs().nan_to_num(0.0)).all()
                  and torch.equal(torch.isinf(lse[:n]), torch.isinf(want_lse)))
    pad_ok = bool(torch.isnan(got[n:]).all())
    # Valid rows only: lse rows past num_tokens are never written (attention() allocates lse uninitialized).
    same = all(torch.equal(_bits(o[:n]), _bits(got[:n])) and torch.equal(_bits(s[:n]), _bits(lse[:n]))
               for o, s in outs[1:])
    return dict(passed=ok_out and ok_lse and pad_ok and same, max_abs_err=float(err.max()) if n else 0.0,
                lse_max_abs_err=float(lse_err.max()) if n else 0.0, padding_untouched=pad_ok, bit_identical=same,
                shared_nodes=len(p.shared_nodes), work_items=p.num_items, tokens=n)


def step_correctness(args, results, skips, device: str) -> None:
    from gpu_check import sanitizer
    from gpu_check.cases import GPU_SCALE, correctness_cases

    clock = Clock("correctness", skips)
    # The sanitizer's cases first: checked here, and compiled before the sanitized processes load them.
    sanitizer.run_all(device, not args.dry_run, results, prefix="[correctness] sanitizer case")
    cases = correctness_cases()
    scale = 1 if args.dry_run else GPU_SCALE
    for i, case in enumerate(cases):
        if clock.expired([c.name for c in cases[i:]]):
            return
        _record(results, "prefixattn", case.name, *guarded(check_case, case, scale, device, seed=i))
    _pdl_cases(results, clock, scale, device)
    _hopper_cases(args, results, clock, scale)


#: The launches chained by PDL in this process: None until the correctness step checked them, else
#: ``(passed, why)``; the timing step times ``prefixattn-pdl`` only after they passed (gpu_check.timing).
PDL_VERDICT: list = []
#: The cases checked again with their launches chained by PDL (``prefixattn-pdl``, sm_90 and newer): the production
#: layout's (bf16, head_dim 128, GQA 8, 16-token pages), of which those whose plan has two launches or more run (a
#: PDL binary is its own compile: ~5 compiles and runs, ~25 s).
PDL_CASE_LAYOUT = "/bfloat16/d128/gqa8/page16"


def _pdl_cases(results, clock, scale: int, device: str) -> None:
    """The production layout's cases whose plan chains two or more launches by PDL, again with it (in this process:
    grid dependency control changes when a launch starts, not what a program reads)."""
    from gpu_check.cases import correctness_cases

    cases = [(i, case) for i, case in enumerate(correctness_cases()) if case.name.endswith(PDL_CASE_LAYOUT)]
    got = []
    for k, (i, case) in enumerate(cases):  # each with the correctness step's seed
        if clock.expired([f"{c.name} (PDL)" for _, c in cases[k:]]):
            break
        r, seconds = guarded(check_case, case, scale, device, seed=i, pdl=True)
        if r is not None:
            _record(results, "prefixattn-pdl", case.name, r, seconds)
            got.append(r["passed"])
    why = ("no plan chains its launches by PDL here (sm_90 and newer, compiled kernels)" if not got else
           f"{got.count(False)} of {len(got)} cases failed" if not all(got) else f"{len(got)} cases passed")
    PDL_VERDICT[:] = [bool(got) and all(got), why]
    print(f"[correctness] prefixattn-pdl: {why}", flush=True)


#: The Hopper build's verdict in this process: None until the correctness step checked it, else
#: ``(passed, why)``; the timing step times ``prefixattn-hopper`` only after it passed (gpu_check.timing).
HOPPER_VERDICT: list = []
#: Seconds the Hopper build's cases may take in their child process (start-up, CUDA, its compiles, ~12 cases).
HOPPER_CHILD_S = 80
#: Feature cases the child runs with the Hopper build too, on the production layout's mixed case at the GPU's scale
#: (bf16, head_dim 128, GQA 8, 16-token pages: plans with a shared and a chunk class it serves): the window's edge
#: (masked in the chunk tiles; 100 tokens, shorter than the chunks), the soft cap, and sinks joining at the merge,
#: which no other case reaches.
HOPPER_FEATURE_CASES = {"window": dict(window_left=100), "soft_cap": dict(logits_soft_cap=30.0),
                        "sinks": dict(sinks=True)}
HOPPER_LINE = "hopper case "


def _hopper_cases(args, results, clock, scale: int) -> None:
    """The cases whose plan takes the Hopper build for a class (``prefixattn-hopper``), again with it, in a child
    process (:func:`hopper_child`): the build has never run on a GPU, and a fault or a hang there must not take this
    process's CUDA context or the rest of the run with it."""
    import json
    import subprocess

    from gpu_check.driver import DRIVER, ROOT

    if args.dry_run:  # the interpreter has no Gluon: no plan takes the build
        HOPPER_VERDICT[:] = [False, "dry run: the interpreter has no Gluon"]
        return
    limit = min(HOPPER_CHILD_S, clock.left())
    code = None  # None: the child did not finish in time
    try:
        proc = subprocess.run([*DRIVER, "--hopper-cases", str(scale)], capture_output=True, text=True, timeout=limit,
                              cwd=ROOT / "bench")
        text, code = proc.stdout + "\n" + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    got = [json.loads(line[len(HOPPER_LINE):]) for line in text.splitlines() if line.startswith(HOPPER_LINE)]
    for r in got:
        _record(results, "prefixattn-hopper", r.pop("case"), r, r.pop("seconds"))
    failed = sum(not r["passed"] for r in got)
    if code is None:
        why = f"did not finish within {limit:.0f} s ({len(got)} cases reported)"
    elif code != 0:
        why = f"exit {code}: " + (text.strip().splitlines() or [""])[-1][:200]
    elif failed or not got:
        why = f"{failed} of {len(got)} cases failed"
    else:
        why = ""
    HOPPER_VERDICT[:] = [not why, why or f"{len(got)} cases passed"]
    print(f"[correctness] prefixattn-hopper: {HOPPER_VERDICT[1]}", flush=True)


def hopper_verdict(args, results, clock) -> list:
    """The Hopper build's verdict in this process (:data:`HOPPER_VERDICT`): the correctness step's, or in a call
    without that step (``--steps class_rates,...``) its child's cases run now, once."""
    from gpu_check.cases import GPU_SCALE

    if not HOPPER_VERDICT:
        _hopper_cases(args, results, clock, 1 if args.dry_run else GPU_SCALE)
    return HOPPER_VERDICT


def hopper_cases() -> list:
    """``[(name, case, seed, features)]``: what the child checks, each correctness case (its seed as the correctness
    step's) and then each of :data:`HOPPER_FEATURE_CASES` on the mixed scenario at the production layout."""
    import torch

    from gpu_check.cases import Case, correctness_cases

    cases = [(case.name, case, i, {}) for i, case in enumerate(correctness_cases())]
    mixed = Case("mixed", torch.bfloat16, 128, 8, 16)
    return cases + [(f"{mixed.name}+{name}", mixed, len(cases) + j, features)
                    for j, (name, features) in enumerate(HOPPER_FEATURE_CASES.items())]


def hopper_child(scale: int) -> int:
    """``--hopper-cases``: each case of :func:`hopper_cases` whose plan takes the Hopper build, with it; one JSON line
    each."""
    import json

    for name, case, seed, features in hopper_cases():
        r, seconds = guarded(check_case, case, scale, "cuda", seed=seed, build="hopper", features=features)
        if r is not None:
            print(HOPPER_LINE + json.dumps({**r, "case": name, "seconds": seconds}), flush=True)
    return 0


def _record(results, provider: str, name: str, r: dict, seconds: float) -> None:
    status = "ok  " if r["passed"] else "FAIL"
    detail = r.get("error") or (f"err={r['max_abs_err']:.2e} lse_err={r['lse_max_abs_err']:.2e} "
                                f"bit_identical={r['bit_identical']} padding_untouched={r['padding_untouched']} "
                                f"items={r['work_items']} shared_nodes={r['shared_nodes']}")
    print(f"[correctness] {status} {provider:18s} {name:42s} {detail} ({seconds:.1f} s)", flush=True)
    for metric in ("passed", "bit_identical", "padding_untouched", "max_abs_err", "lse_max_abs_err"):
        if metric in r:
            results.add("gpu_check_correctness", provider, name, metric, float(r[metric]),
                        "bool" if metric in ("passed", "bit_identical", "padding_untouched") else "abs")
