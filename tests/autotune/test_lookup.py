"""The selection chain: fixed -> user cache -> shipped (nearest bucket) -> cost model -> heuristic."""

import itertools
import json
import warnings

import pytest

from prefixattn.autotune import lookup
from prefixattn.autotune.buckets import Bucket, make_bucket
from prefixattn.autotune.config_space import HEAD_DIMS, AttentionConfig, LaunchOptions, Tiles, prune_reason
from prefixattn.autotune.tables import read_table, suffix_class, table_json, write_table
from prefixattn.autotune.targets import TARGETS
from prefixattn.autotune.tuning_cache import TuningCache, TuningCacheWarning, cache_path

A = AttentionConfig(Tiles(64, 64), Tiles(16, 64), LaunchOptions(num_warps=8, num_stages=2))
B = AttentionConfig(Tiles(128, 32), Tiles(64, 32), LaunchOptions(num_warps=4, num_stages=3))
C = AttentionConfig(Tiles(32, 32), Tiles(32, 32), LaunchOptions(num_warps=4, num_stages=2))
SHAPE = dict(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """No memoized selections, no fixed config, and a private (empty) tuning cache directory per test."""
    monkeypatch.delenv(lookup.FIXED_ENV, raising=False)
    monkeypatch.setenv("PREFIXATTN_TUNING_DIR", str(tmp_path / "tuning"))
    lookup.set_fixed_config(None)
    lookup.clear_caches()
    yield
    lookup.set_fixed_config(None)
    lookup.clear_caches()


def _shipped(monkeypatch, table):
    monkeypatch.setattr(lookup, "load_shipped", lambda name: table)


def test_no_device_uses_the_heuristic():
    sel = lookup.select_config(**SHAPE, target=None)
    assert sel.source == "heuristic"
    assert sel.config == lookup.heuristic_config(sel.bucket)


def test_auto_target_without_gpu_is_heuristic(monkeypatch):
    monkeypatch.setattr(lookup, "detect_target", lambda: None)
    assert lookup.select_config(**SHAPE).source == "heuristic"


def test_planning_target_replaces_the_detected_device_inside_the_context(monkeypatch):
    monkeypatch.setattr(lookup, "detect_target", lambda: None)
    with lookup.planning_target("sm90") as target:
        assert target is TARGETS["sm90"]
        inner = lookup.select_config(**SHAPE)
        with lookup.planning_target("gfx942"):
            assert lookup.select_config(**SHAPE).target == "gfx942"
        assert lookup.select_config(**SHAPE).target == "sm90"
        assert lookup.select_config(**SHAPE, target=None).source == "heuristic"  # an explicit target still wins
    assert (inner.source, inner.target) == ("shipped", "sm90")
    assert lookup.select_config(**SHAPE).source == "heuristic"


def test_unknown_gpu_warns_once_and_falls_back_to_heuristic(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(lookup, "detect_target", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Imaginary GPU 9000")
    lookup._warned_devices.discard("Imaginary GPU 9000")
    with pytest.warns(UserWarning, match="Imaginary GPU 9000"):
        sel = lookup.select_config(**SHAPE)
    assert sel.source == "heuristic"
    lookup.clear_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lookup.select_config(**SHAPE)  # the second detection does not warn again


def test_heuristic_tiles_hold_a_whole_gqa_group_and_follow_the_mode():
    decode = lookup.heuristic_config(make_bucket(head_dim=128, dtype="fp16", group=4, max_q_len=1))
    prefill = lookup.heuristic_config(make_bucket(head_dim=128, dtype="fp16", group=4, max_q_len=512))
    big_group = lookup.heuristic_config(make_bucket(head_dim=256, dtype="fp16", group=16, max_q_len=1))
    assert decode.suffix.block_m == 16 and prefill.suffix.block_m == 64
    assert big_group.suffix.block_m >= 16 and big_group.shared.block_n == 32
    for cfg in (decode, prefill, big_group):
        assert cfg.shared.block_m >= 16


def test_shipped_table_nearest_bucket(monkeypatch):
    near = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=512, max_q_len=1, kv_len=2048)
    far = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=16, max_q_len=1, kv_len=65536)
    _shipped(monkeypatch, {near: A, far: B})
    sel = lookup.select_config(**SHAPE, target="sm90")
    assert (sel.source, sel.config, sel.matched) == ("shipped", A, near)
    sel = lookup.select_config(**{**SHAPE, "q_rows": 16, "kv_len": 40000}, target="sm90")
    assert (sel.config, sel.matched) == (B, far)


def test_shipped_lookup_skips_entries_that_do_not_fit_the_group(monkeypatch):
    small_m = AttentionConfig(Tiles(16, 64), Tiles(16, 64), LaunchOptions())
    near = make_bucket(head_dim=128, dtype="fp16", group=16, q_rows=256, max_q_len=1, kv_len=2048)
    far = make_bucket(head_dim=128, dtype="fp16", group=16, q_rows=256, max_q_len=1, kv_len=65536)
    _shipped(monkeypatch, {near: small_m, far: A})
    sel = lookup.select_config(**{**SHAPE, "group": 32}, target="sm90")
    assert prune_reason(small_m, TARGETS["sm90"], head_dim=128, dtype="fp16", group=32) is not None
    assert sel.config != small_m


def test_shipped_lookup_uses_stand_ins_for_dtype_and_head_dim(monkeypatch):
    b = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048)
    _shipped(monkeypatch, {b: A})
    assert lookup.select_config(**{**SHAPE, "dtype": "bf16"}, target="sm80").config == A
    assert lookup.select_config(**{**SHAPE, "head_dim": 96}, target="sm80").config == A  # same BLOCK_D 128
    assert lookup.select_config(**{**SHAPE, "head_dim": 64}, target="sm80").source == "cost-model"
    assert lookup.select_config(**{**SHAPE, "dtype": "fp32"}, target="sm80").source == "cost-model"


def test_untabled_head_size_uses_the_nearest_padded_row(monkeypatch):
    # 112 pads to BLOCK_D 128 (the d128 row), 192 to 256, 40 to 64; 32 has no BLOCK_D-32 row and takes the next
    # larger padded one (64). A tabled size without its own row (64 here) still goes to the cost model.
    rows = {make_bucket(head_dim=h, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048): cfg
            for h, cfg in ((80, A), (256, B))}
    _shipped(monkeypatch, rows)
    for head_dim, want in ((112, A), (120, A), (192, B), (40, A), (32, A), (56, A)):
        sel = lookup.select_config(**{**SHAPE, "head_dim": head_dim}, target="sm80")
        assert (sel.source, sel.config) == ("shipped", want), head_dim
    assert lookup.select_config(**{**SHAPE, "head_dim": 64}, target="sm80").source == "cost-model"


def _write_cache(target, bucket, cfg, seconds=1e-5):
    cache = TuningCache(cache_path(target))
    cache.put(bucket, cfg, seconds)
    cache.save(target_name=target, device_name="test device")
    return cache.path


def test_user_cache_hit_beats_shipped_and_miss_falls_through(monkeypatch):
    bucket = make_bucket(**SHAPE)
    _shipped(monkeypatch, {bucket: A})
    _write_cache("sm90", bucket, B)
    sel = lookup.select_config(**SHAPE, target="sm90")
    assert (sel.source, sel.config) == ("user-cache", B)
    near = lookup.select_config(**{**SHAPE, "kv_len": 65536, "q_rows": 16}, target="sm90")
    assert (near.source, near.config) == ("user-cache", B)  # same head size, dtype, group and mode
    for miss in ({"group": 8}, {"max_q_len": 64}, {"dtype": "bf16"}):
        sel = lookup.select_config(**{**SHAPE, **miss}, target="sm90")
        assert (sel.source, sel.config) == ("shipped", A), miss


def test_user_cache_nearest_when_no_shipped_table(monkeypatch):
    _shipped(monkeypatch, {})
    _write_cache("gfx950", make_bucket(**SHAPE), C)
    sel = lookup.select_config(**{**SHAPE, "group": 8}, target="gfx950")
    assert (sel.source, sel.config) == ("user-cache-nearest", C)


def test_no_table_and_no_cache_uses_the_cost_model(monkeypatch):
    _shipped(monkeypatch, {})
    sel = lookup.select_config(**SHAPE, target="gfx942")
    assert sel.source == "cost-model"
    assert prune_reason(sel.config, TARGETS["gfx942"], head_dim=128, dtype="fp16", group=4) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "entries": {}}),
                                     json.dumps({"format": 1, "entries": {"x": {"bucket": {}}}}), "\x00\xff"])
def test_corrupt_cache_file_warns_and_falls_back(monkeypatch, content):
    _shipped(monkeypatch, {make_bucket(**SHAPE): A})
    path = cache_path("sm90")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content) if isinstance(content, str) and not content.startswith("\x00") else \
        path.write_bytes(b"\x00\xff\xfe")
    with pytest.warns(TuningCacheWarning, match="ignoring tuning cache"):
        sel = lookup.select_config(**SHAPE, target="sm90")
    assert (sel.source, sel.config) == ("shipped", A)


def test_cache_entries_of_another_kernel_source_are_ignored(monkeypatch, tmp_path):
    _shipped(monkeypatch, {make_bucket(**SHAPE): A})
    path = cache_path("sm90")
    cache = TuningCache(path, fingerprint="0123456789abcdef")
    cache.put(make_bucket(**SHAPE), B, 1e-5)
    cache.save(target_name="sm90")
    with pytest.warns(TuningCacheWarning, match="another version of the kernel"):
        sel = lookup.select_config(**SHAPE, target="sm90")
    assert sel.source == "shipped"


def test_cache_save_roundtrip(tmp_path):
    path = tmp_path / "c" / "sm80.json"
    cache = TuningCache(path)
    b = make_bucket(**SHAPE)
    cache.put(b, B, 2.5e-5)
    cache.save(target_name="sm80", device_name="NVIDIA A100", triton_version="3.9.0")
    again = TuningCache(path)
    assert again.get(b).config == B and again.get(b).seconds == 2.5e-5
    assert again.device_name == "NVIDIA A100"
    assert not list(path.parent.glob("*.tmp"))


def test_fixed_config_mode(monkeypatch):
    with lookup.fixed_config(A):
        assert lookup.select_config(**SHAPE, target="sm90").config == A
        with lookup.fixed_config(B.to_dict()):
            sel = lookup.select_config(**SHAPE, target=None)
            assert (sel.source, sel.config) == ("fixed", B)
        assert lookup.select_config(**SHAPE, target=None).config == A
    assert lookup.select_config(**SHAPE, target=None).source == "heuristic"
    monkeypatch.setenv(lookup.FIXED_ENV, json.dumps(C.to_dict()))
    assert lookup.select_config(**SHAPE, target="gfx942").config == C
    monkeypatch.setenv(lookup.FIXED_ENV, "/nonexistent/config.json")
    with pytest.raises(ValueError, match=lookup.FIXED_ENV):
        lookup.select_config(**SHAPE, target=None)


def test_memoized_tiles_follow_the_selection_state(monkeypatch):
    # choose_tiles is memoized (plan() asks every step): a fixed config, a planning target or the fixed-config
    # variable changes the answer at once, and leaving them brings the previous answer back.
    from prefixattn.planner.tiles import choose_tiles

    def tiles():
        return choose_tiles(head_dim=128, group=4, max_q_len=1, dtype="fp16")

    base = tiles()
    with lookup.fixed_config(A):
        assert (tiles().shared.block_m, tiles().decode.block_n) == (64, 64)
        with lookup.fixed_config(B):
            assert (tiles().shared.block_m, tiles().shared.block_n) == (B.shared.block_m, B.shared.block_n)
        assert tiles().shared.block_m == 64
    assert tiles() == base
    for target in ("sm90", "sm80", "gfx942", None):
        with lookup.planning_target(target):
            cfg = lookup.select_config(head_dim=128, dtype="fp16", group=4, max_q_len=1).config
            t = tiles()
            assert (t.shared.block_m, t.shared.block_n, t.decode.block_m, t.decode.block_n) == (
                cfg.shared.block_m, cfg.shared.block_n, cfg.suffix.block_m, cfg.suffix.block_n), target
    monkeypatch.setenv(lookup.FIXED_ENV, json.dumps(C.to_dict()))
    assert (tiles().shared.block_m, tiles().shared.block_n) == (C.shared.block_m, C.shared.block_n)
    monkeypatch.delenv(lookup.FIXED_ENV)
    assert tiles() == base


def test_selection_is_memoized_no_table_reread(monkeypatch):
    calls = []

    def counting(name):
        calls.append(name)
        return {make_bucket(**SHAPE): A}

    monkeypatch.setattr(lookup, "load_shipped", counting)
    first = lookup.select_config(**SHAPE, target="sm90")
    for _ in range(5):
        assert lookup.select_config(**SHAPE, target="sm90") is first
    assert calls == ["sm90"]


def _table_file(path, target, rows):
    """A tile table of ``rows`` (bucket key -> config) for ``target`` at ``path``."""
    return write_table(table_json({Bucket.from_key(k): cfg for k, cfg in rows.items()}, target=target), path)


def test_measured_overrides_replace_the_analytic_buckets_they_name(monkeypatch, tmp_path):
    analytic = _table_file(tmp_path / "sm90.json", "sm90", {"d128-fp16-g4-q16-l1-kv1024": A,
                                                            "d128-fp16-g4-q16-l512-kv1024": A})
    measured = _table_file(tmp_path / "sm90.measured.json", "sm90", {"d128-fp16-g4-q16-l1-kv1024": B,
                                                                     "d128-fp16-g8-q16-l1-kv1024": B})
    paths = {False: analytic, True: measured}
    monkeypatch.setattr(lookup, "shipped_path", lambda name, measured=False: paths[measured])
    table = lookup.load_shipped("sm90")
    key = lambda k: next(b for b in table if b.key() == k)  # noqa: E731
    assert table[key("d128-fp16-g4-q16-l1-kv1024")] == B  # overridden
    assert table[key("d128-fp16-g4-q16-l512-kv1024")] == A  # kept
    assert table[key("d128-fp16-g8-q16-l1-kv1024")] == B and len(table) == 3  # added
    lookup.clear_caches()
    paths[True] = tmp_path / "absent.json"  # a target without measurements: the analytic table alone
    assert set(lookup.load_shipped("sm90").values()) == {A}


def test_a_measured_table_for_another_target_is_refused(monkeypatch, tmp_path):
    analytic = _table_file(tmp_path / "sm90.json", "sm90", {"d128-fp16-g4-q16-l1-kv1024": A})
    wrong = _table_file(tmp_path / "sm90.measured.json", "sm80", {"d128-fp16-g4-q16-l1-kv1024": B})
    monkeypatch.setattr(lookup, "shipped_path", lambda name, measured=False: wrong if measured else analytic)
    with pytest.raises(ValueError, match="sm90.measured.json: expected the table of target 'sm90', got one for 'sm80'"):
        lookup.load_shipped("sm90")


def test_the_shipped_sm90_measurements_reach_the_selection():
    """configs/sm90.measured.json (H100 sweep): its decode buckets win over the analytic table's, the buckets it does
    not name (chunked prefill, group 16) keep the analytic rows."""
    measured_path, analytic_path = lookup.shipped_path("sm90", measured=True), lookup.shipped_path("sm90")
    raw = json.loads(measured_path.read_text())
    assert raw["target"] == "sm90" and "measured" in raw["source"] and raw["decode"] and not raw["chunk"]
    measured, analytic = read_table(measured_path, "sm90"), read_table(analytic_path, "sm90")
    for group, max_q_len, is_measured in ((1, 1, True), (4, 1, True), (8, 1, True), (16, 1, False), (1, 300, False),
                                          (8, 300, False)):
        sel = lookup.select_config(head_dim=128, dtype="bf16", group=group, max_q_len=max_q_len, target="sm90")
        assert sel.source == "shipped" and (sel.matched in measured) == is_measured, (group, max_q_len, sel.matched)
        assert sel.config == (measured if is_measured else analytic)[sel.matched], (group, max_q_len)


@pytest.mark.parametrize("target", ["sm80", "sm90", "gfx90a", "gfx942", "sm89", "gfx950"])
def test_shipped_tables_cover_every_head_dim_and_dtype(target):
    table = lookup.load_shipped(target)
    raw = json.loads(lookup.shipped_path(target).read_text())
    assert raw["target"] == target
    for head_dim, dtype in itertools.product(HEAD_DIMS, ("fp16", "bf16", "fp32")):
        rows = [b for b in table if (b.head_dim, b.dtype) == (head_dim, dtype)]
        assert {suffix_class(b) for b in rows} == {"decode", "chunk"}, (head_dim, dtype)  # a row of each kind
    for head_dim in (64, 80, 96, 128, 256):
        for dtype in ("fp16", "bf16", "fp32"):
            for max_q_len in (1, 300):
                sel = lookup.select_config(head_dim=head_dim, dtype=dtype, group=8, q_rows=100,
                                           max_q_len=max_q_len, kv_len=3000, target=target)
                assert sel.source == "shipped", (head_dim, dtype, sel)
                assert sel.config in table.values()
