"""Hardware and model presets for the simulator, each with the public source of its numbers.

Hardware numbers are the vendors' spec-sheet peaks (dense, no sparsity). Model numbers are the published
``config.json`` of each checkpoint. Values that are not on a spec sheet (the kernel launch overhead, most L2
bandwidth ceilings) are labelled as assumptions in their ``sources`` entry; efficiency factors live in
:mod:`prefixattn.sim.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from prefixattn.planner.cost_rule import mla_cost_head_dim, mla_heads_per_program

GIB = 1024 ** 3
_TERA = 1e12


@dataclass(frozen=True)
class HardwarePreset:
    """Peak numbers of one accelerator as a single process sees it.

    Attributes
    ----------
    name : str
        Canonical preset name (``a100-80gb``...).
    peak_flops : float
        Dense fp16/bf16 tensor FLOP/s (no sparsity).
    hbm_bandwidth : float
        Peak HBM bandwidth, bytes/s.
    memory_bytes : int
        Device memory, bytes.
    num_sms : int
        Streaming multiprocessors (NVIDIA) or compute units (AMD).
    launch_overhead_s : float
        Device-side gap per kernel launch (assumption, see ``sources``).
    l2_bytes : int
        The last-level cache every SM shares (L2; AMD MI300X: the Infinity Cache), bytes.
    l2_bandwidth : float
        A ceiling on that cache's read bandwidth, bytes/s (the calibration's ``l2_bw_efficiency`` is a fraction
        of it; it is at least ``hbm_bandwidth``, since HBM reads pass through it).
    vendor : str
        ``"nvidia"`` or ``"amd"``.
    sources : dict
        Field -> where the number comes from.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: int
    num_sms: int
    launch_overhead_s: float
    l2_bytes: int
    l2_bandwidth: float
    vendor: str
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.l2_bandwidth >= self.hbm_bandwidth:
            raise ValueError(f"l2_bandwidth: expected >= hbm_bandwidth ({self.hbm_bandwidth:g}) for {self.name}, got "
                             f"{self.l2_bandwidth!r}")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


_NV_LAUNCH = ("assumption: ~4 us device-side gap between back-to-back eager kernel launches, the order of magnitude "
              "commonly measured for CUDA launch latency; not a spec-sheet number")
MIB = 1024 ** 2
#: NVIDIA A100 Tensor Core GPU Architecture whitepaper: "A100 L2 cache read bandwidth is 5120 Bytes/clk" (2.3x V100).
_NV_L2_BYTES_PER_CLK = 5120
_A100_BOOST_HZ = 1.41e9
#: Hopper's L2 read bandwidth is not published: A100's bytes per clock at the H100 SXM5 boost clock (1,980 MHz).
_HOPPER_BOOST_HZ = 1.98e9
_HOPPER_L2_BW = ("assumption: no published figure for Hopper; A100's 5,120 B/clk (A100 whitepaper) at the H100 SXM5 "
                 "boost clock of 1,980 MHz = 10.1 TB/s, a ceiling for the fitted l2_bw_efficiency")
_AMD_LAUNCH = ("assumption: ~8 us, ROCm/HIP launches are commonly measured at about twice CUDA's latency; BatchLLM "
               "sec. 5 uses AOTriton on AMD precisely to cut launch cost; not a spec-sheet number")

#: One MI250X GCD's L2 and a ceiling on its bandwidth (AMD publishes no L2 bandwidth for CDNA 2).
_CDNA2_L2_BYTES = 8 * MIB
_CDNA2_L2_SOURCE = "AMD CDNA 2 white paper: 8 MB L2 per GCD"
_CDNA2_L2_CHANNELS = 32
_CDNA2_L2_BYTES_PER_CLK_PER_CHANNEL = 64
_CDNA2_BOOST_HZ = 1.7e9
_CDNA2_L2_BW = _CDNA2_L2_CHANNELS * _CDNA2_L2_BYTES_PER_CLK_PER_CHANNEL * _CDNA2_BOOST_HZ
_CDNA2_L2_BW_SOURCE = ("assumption: 32 L2 channels (ROCm Compute Profiler, L2 cache: 32 on MI2XX) x 64 B/clk each "
                       "(assumed, not published) at the 1,700 MHz peak engine clock = 3.5 TB/s per GCD")

HARDWARE: dict[str, HardwarePreset] = {
    "a100-80gb": HardwarePreset(
        name="a100-80gb", peak_flops=312 * _TERA, hbm_bandwidth=2039e9, memory_bytes=80 * 10 ** 9, num_sms=108,
        launch_overhead_s=4e-6, l2_bytes=40 * MIB, l2_bandwidth=_NV_L2_BYTES_PER_CLK * _A100_BOOST_HZ, vendor="nvidia",
        sources={"peak_flops": "NVIDIA A100 datasheet: 312 TFLOPS BF16/FP16 tensor (dense)",
                 "hbm_bandwidth": "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e",
                 "memory_bytes": "NVIDIA A100 datasheet: 80 GB", "num_sms": "NVIDIA Ampere GA100 whitepaper: 108 SMs",
                 "launch_overhead_s": _NV_LAUNCH, "l2_bytes": "NVIDIA A100 whitepaper: 40 MB L2 cache",
                 "l2_bandwidth": "NVIDIA A100 whitepaper: 5,120 B/clk L2 read bandwidth, at the 1,410 MHz boost "
                                 "clock = 7.2 TB/s"}),
    "h100-sxm": HardwarePreset(
        name="h100-sxm", peak_flops=989.4 * _TERA, hbm_bandwidth=3.35e12, memory_bytes=80 * 10 ** 9, num_sms=132,
        launch_overhead_s=4e-6, l2_bytes=50 * MIB, l2_bandwidth=_NV_L2_BYTES_PER_CLK * _HOPPER_BOOST_HZ,
        vendor="nvidia",
        sources={"peak_flops": "NVIDIA H100 SXM datasheet: 1,979 TFLOPS BF16 with sparsity = 989.4 dense",
                 "hbm_bandwidth": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3", "memory_bytes": "datasheet: 80 GB",
                 "num_sms": "NVIDIA Hopper whitepaper: 132 SMs (SXM5)", "launch_overhead_s": _NV_LAUNCH,
                 "l2_bytes": "NVIDIA Hopper whitepaper: 50 MB L2 cache (H100 SXM5)", "l2_bandwidth": _HOPPER_L2_BW}),
    "h200": HardwarePreset(
        name="h200", peak_flops=989.4 * _TERA, hbm_bandwidth=4.8e12, memory_bytes=141 * 10 ** 9, num_sms=132,
        launch_overhead_s=4e-6, l2_bytes=60 * MIB, l2_bandwidth=_NV_L2_BYTES_PER_CLK * _HOPPER_BOOST_HZ,
        vendor="nvidia",
        sources={"peak_flops": "NVIDIA H200 SXM datasheet: 1,979 TFLOPS BF16 with sparsity = 989.4 dense",
                 "hbm_bandwidth": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e", "memory_bytes": "datasheet: 141 GB",
                 "num_sms": "same GH100 die as H100 SXM: 132 SMs", "launch_overhead_s": _NV_LAUNCH,
                 "l2_bytes": "60 MiB: the L2 the GPU check reads from the H200 (torch.cuda.get_device_properties); "
                             "the full GH100 die holds 60 MB (Hopper whitepaper)",
                 "l2_bandwidth": _HOPPER_L2_BW}),
    # MI250X is two GCDs in one package; each GCD is a separate device to the runtime. The package numbers are the
    # spec sheet's; `mi250x-gcd` is what one process (one GPU in vLLM) actually drives.
    "mi250x": HardwarePreset(
        name="mi250x", peak_flops=383 * _TERA, hbm_bandwidth=3.2768e12, memory_bytes=128 * GIB, num_sms=220,
        launch_overhead_s=8e-6, l2_bytes=2 * _CDNA2_L2_BYTES, l2_bandwidth=2 * _CDNA2_L2_BW, vendor="amd",
        sources={"peak_flops": "AMD Instinct MI250X datasheet: 383 TFLOPS peak FP16/BF16 (package, 2 GCDs)",
                 "hbm_bandwidth": "AMD MI250X datasheet: 3.2768 TB/s HBM2e", "memory_bytes": "datasheet: 128 GB",
                 "num_sms": "datasheet: 220 compute units", "launch_overhead_s": _AMD_LAUNCH,
                 "l2_bytes": "two GCDs' L2 (" + _CDNA2_L2_SOURCE + "); each GCD caches only its own requests",
                 "l2_bandwidth": "two GCDs' (" + _CDNA2_L2_BW_SOURCE + ")"}),
    "mi250x-gcd": HardwarePreset(
        name="mi250x-gcd", peak_flops=191.5 * _TERA, hbm_bandwidth=1.6384e12, memory_bytes=64 * GIB, num_sms=110,
        launch_overhead_s=8e-6, l2_bytes=_CDNA2_L2_BYTES, l2_bandwidth=_CDNA2_L2_BW, vendor="amd",
        sources={"peak_flops": "half of the MI250X package (one of its two GCDs): 191.5 TFLOPS",
                 "hbm_bandwidth": "half of 3.2768 TB/s", "memory_bytes": "64 GB per GCD",
                 "num_sms": "110 CUs per GCD", "launch_overhead_s": _AMD_LAUNCH, "l2_bytes": _CDNA2_L2_SOURCE,
                 "l2_bandwidth": _CDNA2_L2_BW_SOURCE}),
    "mi300x": HardwarePreset(
        name="mi300x", peak_flops=1307.4 * _TERA, hbm_bandwidth=5.3e12, memory_bytes=192 * 10 ** 9, num_sms=304,
        launch_overhead_s=8e-6, l2_bytes=256 * MIB, l2_bandwidth=17.2 * _TERA, vendor="amd",
        sources={"peak_flops": "AMD Instinct MI300X datasheet: 1,307.4 TFLOPS peak FP16/BF16 dense",
                 "hbm_bandwidth": "AMD MI300X datasheet: 5.3 TB/s HBM3", "memory_bytes": "datasheet: 192 GB",
                 "num_sms": "datasheet: 304 compute units", "launch_overhead_s": _AMD_LAUNCH,
                 "l2_bytes": "AMD CDNA 3 white paper: 256 MB Infinity Cache shared by all XCDs (each XCD's 4 MB L2 "
                             "caches only its own CUs)",
                 "l2_bandwidth": "AMD CDNA 3 white paper: Infinity Cache peak bandwidth 17.2 TB/s"}),
}

#: Short names users type. "mi200" is what the BatchLLM paper calls its AMD GPU; one GCD is one vLLM device.
HARDWARE_ALIASES = {"a100": "a100-80gb", "a100-80g": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200",
                    "mi200": "mi250x-gcd", "mi250": "mi250x-gcd", "mi300": "mi300x"}


class AttentionGeometry(NamedTuple):
    """:meth:`ModelPreset.attention_geometry`: query heads per program (the sharing rule's ``group``), programs per
    query tile (KV heads, or MLA head blocks), the head size a KV position is priced at (K and V each), multiply-adds
    per (query, key, head), and the width of a partial state."""

    group: int
    kv_heads: int
    cost_head_dim: int
    macs_per_pair: int
    state_dim: int


#: Multiply-adds per (query, key, head-dim element) of MHA/GQA: QK^T and PV.
_QK_AND_PV = 2


@dataclass(frozen=True)
class ModelPreset:
    """A decoder-only transformer from its public ``config.json``.

    Attributes
    ----------
    num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size : int
        The config fields of the same meaning (``head_dim`` = hidden / heads where the config has none; MLA: the
        ``qk_nope_head_dim``, and ``num_kv_heads`` 1, the latent).
    max_model_len : int
        ``max_position_embeddings`` (vLLM's default max_model_len; sets its unchunked prefill budget).
    dtype_bytes : int
        Bytes per weight / KV element (2 for the published bf16 checkpoints).
    tied_embeddings : bool
        Whether the LM head reuses the embedding matrix (no extra weight bytes).
    kv_lora_rank, rope_dim, v_head_dim, q_lora_rank : int
        MLA (DeepSeek-V2/V3, Kimi-K2; 0: MHA/GQA): a token caches one latent of ``kv_lora_rank`` plus a rotary key of
        ``rope_dim`` per layer; queries are ``head_dim + rope_dim`` wide per head (through a ``q_lora_rank``
        bottleneck where nonzero), values ``v_head_dim``. Attention runs in the absorbed form (what prefixattn's and
        the engines' MLA decode kernels run).
    num_experts, experts_per_token, moe_intermediate_size, num_shared_experts, dense_layers : int
        Mixture of experts (0: a dense MLP of ``intermediate_size``): routed experts, the ones each token takes, each
        one's intermediate size, experts every token takes, and the first layers that keep the dense MLP.
    source : str
        Where the numbers come from.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    dense_layers: int = 0
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_geometry(self) -> "AttentionGeometry":
        """How an attention kernel's programs see this model's heads (the planner's view, so the simulator's units
        and sharing rule are the library's). MLA in prefixattn's kernel (absorbed form): a program packs one head
        block of query heads against the one latent, which each head block reads, priced as K and V of half its width
        (:func:`~prefixattn.planner.cost_rule.mla_cost_head_dim`); per (query, key, head) a score over the latent and
        rotary key, then the latent as the value."""
        if not self.is_mla:
            return AttentionGeometry(group=self.num_heads // self.num_kv_heads, kv_heads=self.num_kv_heads,
                                     cost_head_dim=self.head_dim, macs_per_pair=_QK_AND_PV * self.head_dim,
                                     state_dim=self.head_dim)
        group = mla_heads_per_program(self.num_heads)
        return AttentionGeometry(group=group, kv_heads=self.num_heads // group,
                                 cost_head_dim=mla_cost_head_dim(self.kv_lora_rank, self.rope_dim),
                                 macs_per_pair=self.kv_lora_rank + self.rope_dim + self.kv_lora_rank,
                                 state_dim=self.kv_lora_rank)

    @property
    def q_size(self) -> int:
        return self.num_heads * (self.head_dim + self.rope_dim)

    @property
    def kv_size(self) -> int:
        """Elements of one KV tensor of one token and layer: all KV heads (MLA: the latent and rotary key, which
        serve as K and V)."""
        return self.kv_lora_rank + self.rope_dim if self.is_mla else self.num_kv_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements one token caches per layer: K and V (MLA: the one latent row)."""
        return self.kv_size if self.is_mla else 2 * self.kv_size

    @property
    def out_size(self) -> int:
        """Width of the attention output the O projection reads."""
        return self.num_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def attention_shapes(self) -> list[tuple[str, int, int]]:
        """(name, K, N) of one layer's attention GEMMs. MLA: the query (through its bottleneck), the latent and rotary
        key (``kv_a``), ``kv_b`` (the absorbed form's per-head ``W_UK`` and ``W_UV``: the same weights and, per token,
        the same FLOPs as up-projecting it), O."""
        h = self.hidden_size
        if not self.is_mla:
            return [("qkv", h, self.q_size + 2 * self.kv_size), ("o", self.q_size, h)]
        q = [("q_a", h, self.q_lora_rank), ("q_b", self.q_lora_rank, self.q_size)] if self.q_lora_rank else \
            [("q", h, self.q_size)]
        return q + [("kv_a", h, self.kv_size),
                    ("kv_b", self.kv_lora_rank, self.num_heads * (self.head_dim + self.v_head_dim)),
                    ("o", self.out_size, h)]

    def mlp_shapes(self, dense: bool) -> list[tuple[str, int, int, int]]:
        """(name, K, N, experts) of one layer's MLP GEMMs; ``experts`` > 0: that many routed experts' GEMMs, each over
        its share of the tokens (``experts_per_token / experts``). ``dense``: a dense layer's MLP."""
        h = self.hidden_size
        if dense or not self.num_experts:
            return [("gate_up", h, 2 * self.intermediate_size, 0), ("down", self.intermediate_size, h, 0)]
        e, shared = self.moe_intermediate_size, self.num_shared_experts * self.moe_intermediate_size
        out = [("shared_gate_up", h, 2 * shared, 0), ("shared_down", shared, h, 0)] if shared else []
        return out + [("experts_gate_up", h, 2 * e, self.num_experts), ("experts_down", e, h, self.num_experts)]

    def layer_kinds(self) -> list[tuple[int, list[tuple[str, int, int, int]]]]:
        """``(layers, GEMMs)`` per kind of decoder layer (dense first, then MoE), GEMMs as :meth:`mlp_shapes`."""
        attention = [(name, k, n, 0) for name, k, n in self.attention_shapes()]
        dense = self.num_layers if not self.num_experts else self.dense_layers
        kinds = [(dense, attention + self.mlp_shapes(True))] if dense else []
        if self.num_layers > dense:
            kinds.append((self.num_layers - dense, attention + self.mlp_shapes(False)))
        return kinds

    @property
    def decoder_params(self) -> int:
        """Weights of all decoder layers (every expert)."""
        return sum(count * sum(k * n * max(experts, 1) for _, k, n, experts in gemms)
                   for count, gemms in self.layer_kinds())

    @property
    def decoder_active_params(self) -> int:
        """Weights of all decoder layers that one token multiplies (its ``experts_per_token`` routed experts)."""
        return sum(count * sum(k * n * (self.experts_per_token if experts else 1) for _, k, n, experts in gemms)
                   for count, gemms in self.layer_kinds())

    @property
    def num_params(self) -> int:
        """Weights: the decoder layers, the embedding and (untied) LM head; norms and routers are negligible."""
        embed = self.vocab_size * self.hidden_size
        return self.decoder_params + embed * (1 if self.tied_embeddings else 2)

    @property
    def active_params(self) -> int:
        """:attr:`num_params` with one token's routed experts only (a dense model: all of them)."""
        return self.num_params - self.decoder_params + self.decoder_active_params

    @property
    def mlp_active_intermediate(self) -> int:
        """Intermediate width of one token's MLP (its routed and shared experts', in an MoE layer)."""
        if not self.num_experts:
            return self.intermediate_size
        return (self.experts_per_token + self.num_shared_experts) * self.moe_intermediate_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (BatchLLM sec. 2.2: 2 x n_bytes x n_layers x n_kvhead x d_head; MLA:
        the latent row)."""
        return self.dtype_bytes * self.num_layers * self.kv_width


MODELS: dict[str, ModelPreset] = {
    "llama-3-8b": ModelPreset(
        name="llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_model_len=8192,
        source="meta-llama/Meta-Llama-3-8B config.json"),
    "llama-3.1-8b": ModelPreset(
        name="llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_model_len=131072,
        source="meta-llama/Llama-3.1-8B config.json (same shapes as Llama-3-8B; only rope scaling differs)"),
    "mistral-7b": ModelPreset(
        name="mistral-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32000, max_model_len=32768,
        source="mistralai/Mistral-7B-v0.1 config.json (sliding window 4096 not modelled: seed prompts are shorter)"),
    "qwen2-7b": ModelPreset(
        name="qwen2-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
        intermediate_size=18944, vocab_size=152064, max_model_len=32768,
        source="Qwen/Qwen2-7B config.json"),
    # MLA and MoE; fits one GPU (15.7B weights, 2.4B active per token).
    "deepseek-v2-lite": ModelPreset(
        name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_heads=16, num_kv_heads=1, head_dim=128,
        intermediate_size=10944, vocab_size=102400, max_model_len=163840, kv_lora_rank=512, rope_dim=64,
        v_head_dim=128, num_experts=64, experts_per_token=6, moe_intermediate_size=1408, num_shared_experts=2,
        dense_layers=1,
        source="deepseek-ai/DeepSeek-V2-Lite config.json (qk_nope_head_dim 128 as head_dim, qk_rope_head_dim 64, "
               "no q_lora_rank, first_k_dense_replace 1, n_routed_experts 64, num_experts_per_tok 6, "
               "n_shared_experts 2)"),
}

MODEL_ALIASES = {"llama3-8b": "llama-3-8b", "llama-3.1-8b-instruct": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b",
                 "mistral": "mistral-7b", "qwen2": "qwen2-7b", "deepseek-v2-lite-chat": "deepseek-v2-lite"}


def get_hardware(name: str | HardwarePreset) -> HardwarePreset:
    """Look up a hardware preset by name or alias (case-insensitive).

    Examples
    --------
    >>> get_hardware("a100").hbm_bandwidth
    2039000000000.0
    """
    if isinstance(name, HardwarePreset):
        return name
    key = HARDWARE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in HARDWARE:
        raise ValueError(f"gpu: expected one of {sorted(HARDWARE) + sorted(HARDWARE_ALIASES)}, got {name!r}")
    return HARDWARE[key]


def get_model(name: str | ModelPreset) -> ModelPreset:
    """Look up a model preset by name or alias (case-insensitive).

    Examples
    --------
    >>> get_model("mistral-7b").kv_bytes_per_token  # 0.125 MiB, as BatchLLM sec. 2.2 says
    131072
    """
    if isinstance(name, ModelPreset):
        return name
    key = MODEL_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS) + sorted(MODEL_ALIASES)}, got {name!r}")
    return MODELS[key]
