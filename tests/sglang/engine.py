"""A miniature SGLang engine on CPU: SGLang's real pools, radix cache, ForwardBatch and attention layer objects.

What SGLang's scheduler and model runner do around an attention backend, reduced to the steps that decide what the
backend sees:

* a request's token slots come from the radix cache for its cached prefix (``RadixCache.match_prefix``: identical
  slot ids for every request sharing that prefix) and from fresh slots for the rest, page by page;
* its ``req_to_token`` row holds those slots; an EXTEND/MIXED/DECODE ``ForwardBatch`` carries ``req_pool_indices``,
  ``seq_lens``, ``out_cache_loc`` (the new tokens' slots) and the prefix/extend lengths;
* after a prefill the request's tokens go into the radix cache with their slots.

Two attention backends run side by side on two separate KV pools (each backend writes its own K/V with
``set_kv_buffer``), so a backend that wrote wrong slots cannot borrow the other one's writes.
"""

from __future__ import annotations

import array
import types
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

#: Slot 0 (page 0) of SGLang's KV pool and row 0 of its req_to_token pool are padding; real ones start after them.
FIRST_ROW = 1


@dataclass
class Request:
    tokens: list[int]                      # the whole prompt (+ decoded tokens)
    row: int                               # req_to_token row
    slots: list[int] = field(default_factory=list)  # KV slots of tokens[:len(slots)] (computed or being computed)
    cached_len: int = 0                    # tokens whose KV came from the radix cache at admission


class MiniEngine:
    """SGLang pools + radix cache + one attention layer, and backends built over their own copies of the KV pool."""

    def __init__(self, *, num_heads=4, num_kv_heads=2, head_dim=64, page_size=1, dtype=torch.float32,
                 num_pages=128, max_reqs=16, max_context=256, seed=0, num_layers=1, kv_dtype=None):
        self.page_size, self.dtype = page_size, dtype
        self.num_layers, self.kv_dtype = num_layers, kv_dtype if kv_dtype is not None else dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context, device="cpu", enable_memory_saver=False)
        self.radix = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=None, page_size=page_size))
        self.pool_size = num_pages * page_size
        self.layer = RadixAttention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads, layer_id=0)
        self.next_page = 1  # page 0 is padding
        self.next_row = FIRST_ROW
        self.requests: list[Request] = []
        self.gen = torch.Generator().manual_seed(seed)

    # -- backends --------------------------------------------------------------------------------------------------
    def make_pool(self) -> MHATokenToKVPool:
        return MHATokenToKVPool(self.pool_size, self.page_size, self.kv_dtype, self.num_kv_heads, self.head_dim,
                                layer_num=self.num_layers, device="cpu", enable_memory_saver=False,
                                enable_alt_stream=False)

    def runner(self, pool) -> types.SimpleNamespace:
        """What SGLang's ModelRunner hands an attention backend (device and pools)."""
        return types.SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=pool)

    # -- requests --------------------------------------------------------------------------------------------------
    def add_request(self, tokens: list[int]) -> int:
        """Admit a request: its cached prefix from the radix cache (shared slots), nothing computed beyond it."""
        match = self.radix.match_prefix(MatchPrefixParams(key=RadixKey(array.array("l", tokens))))
        cached = match.device_prefix_len
        # A request whose whole prompt is cached still recomputes its last token (SGLang needs its logits).
        cached = min(cached, len(tokens) - 1) // self.page_size * self.page_size
        slots = self.radix.path_device_indices(match.last_device_node)[:cached].tolist() if cached else []
        req = Request(tokens=list(tokens), row=self.next_row, slots=list(slots), cached_len=cached)
        self.next_row += 1
        self.req_to_token_pool.req_to_token[req.row, :cached] = torch.tensor(slots, dtype=torch.int32)
        self.requests.append(req)
        return len(self.requests) - 1

    def _alloc(self, req: Request, n: int) -> list[int]:
        """Slots for the next ``n`` tokens: the rest of the request's last page, then fresh pages."""
        new = []
        pos = len(req.slots)
        for _ in range(n):
            if pos % self.page_size == 0:
                if self.next_page * self.page_size >= self.pool_size:
                    raise RuntimeError("MiniEngine: KV pool exhausted; give it more num_pages")
                page = self.next_page
                self.next_page += 1
            else:
                page = (req.slots[-1] if not new else new[-1]) // self.page_size
            new.append(page * self.page_size + pos % self.page_size)
            pos += 1
        req.slots.extend(new)
        self.req_to_token_pool.req_to_token[req.row, pos - n:pos] = torch.tensor(new, dtype=torch.int32)
        return new

    def cache_request(self, i: int) -> None:
        """Insert a request's computed tokens (whole pages) into the radix cache, as SGLang does after a prefill."""
        req = self.requests[i]
        n = len(req.slots) // self.page_size * self.page_size
        self.radix.insert(InsertParams(key=RadixKey(array.array("l", req.tokens[:n])),
                                       value=torch.tensor(req.slots[:n], dtype=torch.int64)))

    def append_token(self, i: int, token: int) -> None:
        self.requests[i].tokens.append(token)

    # -- batches ---------------------------------------------------------------------------------------------------
    def batch(self, extend: dict[int, int], mode: ForwardMode) -> ForwardBatch:
        """ForwardBatch computing the next ``extend[i]`` tokens of each request ``i`` (allocating their slots).

        DECODE needs every count to be 1; EXTEND and MIXED take any counts (MIXED: decode requests have 1).
        """
        idx = list(extend)
        prefix_lens, extend_lens, out_loc, input_ids, positions = [], [], [], [], []
        for i in idx:
            req, n = self.requests[i], extend[i]
            start = len(req.slots)
            if start + n > len(req.tokens):
                raise ValueError(f"request {i}: only {len(req.tokens) - start} tokens left to compute, asked {n}")
            out_loc += self._alloc(req, n)
            prefix_lens.append(start)
            extend_lens.append(n)
            input_ids += req.tokens[start:start + n]
            positions += list(range(start, start + n))
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(idx), input_ids=i64(input_ids),
            req_pool_indices=i64([self.requests[i].row for i in idx]), seq_lens=i64(seq_lens),
            out_cache_loc=i64(out_loc), seq_lens_sum=sum(seq_lens), seq_lens_cpu=i64(seq_lens),
            positions=i64(positions),
        )
        if mode != ForwardMode.DECODE:
            fb.extend_num_tokens = sum(extend_lens)
            fb.extend_prefix_lens, fb.extend_seq_lens = i64(prefix_lens), i64(extend_lens)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix_lens, extend_lens
            fb.extend_start_loc = torch.cumsum(i64([0] + extend_lens[:-1]), 0)
        elif any(n != 1 for n in extend_lens):
            raise ValueError("DECODE batches compute exactly one token per request")
        return fb

    def qkv(self, num_tokens: int):
        """Random q ``[T, H*D]`` and new k, v ``[T, Hkv, D]`` as a model layer would produce them."""
        q = torch.randn(num_tokens, self.num_heads * self.head_dim, generator=self.gen).to(self.dtype)
        k = torch.randn(num_tokens, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
        v = torch.randn(num_tokens, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
        return q, k, v
