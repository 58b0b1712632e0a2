"""The tile tables: the tiles and launch options each work class runs, by bucketed shape.

The package ships one table per target (``configs/<target>.json``, built by ``prefixattn tune --write-shipped``) and,
where a GPU measured some buckets, their overrides (``configs/<target>.measured.json``). A table is a JSON object::

    {"format": 2, "target": "sm90", "source": "how the table was made",
     "shared": {"d128-bf16-g1-q16-l1-kv1024": "128x64_w8_s3", "d128-bf16-g1-q16-l512-kv1024": "128x32_w8_s3"},
     "chunk": {"d128-bf16-g1-q16-l512-kv1024": "128x64_w8_s3"},
     "decode": {"d128-bf16-g1-q16-l1-kv1024": "16x32_w4_s3"},
     "tiles": {"128x64_w8_s3": {"block_m": 128, "block_n": 64, "launch": {"num_warps": 8, "num_stages": 3}}, ...}}

One section per work class (:data:`~prefixattn.kernels.layout.WORK_CLASSES`) maps a bucket key
(:meth:`~prefixattn.autotune.buckets.Bucket.key`) to a tile by name; ``tiles`` defines every name once: ``BLOCK_M``
x ``BLOCK_N`` and the launch options (:class:`~prefixattn.autotune.config_space.LaunchOptions`), which the name spells
out (:func:`tile_name`). A bucket is a row of the table:

* a **decode row** (one query token per request, ``l1``) names the tiles of the shared and the decode class: a
  step's shared and decode tiles are looked up at one query token per request
  (:func:`prefixattn.planner.tiles.choose_tiles`);
* a **chunk row** (``l`` above 1) names the tiles of the chunk class, and a shared tile. The lookup takes a step's
  shared and decode tiles from the nearest row whose tiles hold its GQA group; where no decode tile does (groups
  above 16 with 16-row decode tiles) that is a chunk row, whose shared tile then runs the shared class and its chunk
  tile the decode class.

In memory a row is one :class:`~prefixattn.autotune.config_space.AttentionConfig` (its ``shared`` tiles under
``launch``, its ``suffix`` tiles, the decode or chunk tile, under ``suffix_launch``): what the lookup
(:mod:`prefixattn.autotune.lookup`) ranks and hands to the planner. :func:`read_table` reads a table, :func:`table_json`
writes one; every tile a table defines is named by a row, and every row names both of its tiles.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixattn.autotune.buckets import Bucket
from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles, check_launch, check_tiles
from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED, WORK_CLASSES

#: The table format :func:`read_table` reads and :func:`table_json` writes; a table of any other raises a ValueError
#: naming its file.
TABLE_FORMAT = 2
SHARED, CHUNK, DECODE = (WORK_CLASSES[c] for c in (CLASS_SHARED, CLASS_CHUNK, CLASS_DECODE))
#: Sections a table may hold besides the class sections and ``tiles``, for its readers: how it was made, the device a
#: sweep ran on, notes on the evidence (written before the rows), and the builder's compile-check exclusions, which a
#: rebuild keeps (written after them).
_LEADING_METADATA = ("source", "device", "notes")
_TRAILING_METADATA = ("excluded_after_compile_check",)
#: The keys of a tile in the ``tiles`` section (``kv_heads`` only where it is not 1).
_TILE_KEYS = {"block_m", "block_n", "kv_heads", "launch"}
METADATA_KEYS = _LEADING_METADATA + _TRAILING_METADATA
_REQUIRED_KEYS = ("format", "target", SHARED, CHUNK, DECODE, "tiles")


def suffix_class(bucket: Bucket) -> str:
    """The class whose tile a row of ``bucket`` names besides the shared one: decode for one query token per request
    (the shape a step's decode tiles are looked up at), chunk otherwise."""
    return DECODE if bucket.max_q_len == 1 else CHUNK


def tile_name(tiles: Tiles, launch: LaunchOptions) -> str:
    """A table's name of ``tiles`` under ``launch``: ``128x64_w8_s3`` (``16x32h4_w4_s3`` with 4 KV heads per
    program; + the HIP knobs when set)."""
    return f"{tiles.short()}_{launch.short()}"


def table_json(rows: dict, *, target: str, **metadata) -> dict:
    """The table of ``rows`` (bucket -> the :class:`AttentionConfig` the lookup reads there) for ``target``, with
    ``metadata`` (keys of :data:`METADATA_KEYS`), as :func:`read_table` reads it."""
    unknown = sorted(set(metadata) - set(METADATA_KEYS))
    if unknown:
        raise ValueError(f"metadata: expected keys of {METADATA_KEYS}, got {unknown}")
    sections: dict = {SHARED: {}, CHUNK: {}, DECODE: {}}
    tiles: dict = {}
    for bucket, cfg in sorted(rows.items()):
        for cls, part, launch in ((SHARED, cfg.shared, cfg.launch_for(True)),
                                  (suffix_class(bucket), cfg.suffix, cfg.launch_for(False))):
            name = tile_name(part, launch)
            tiles[name] = {**part.to_dict(), "launch": launch.to_dict()}
            sections[cls][bucket.key()] = name
    return {"format": TABLE_FORMAT, "target": target, **{k: metadata[k] for k in _LEADING_METADATA if k in metadata},
            **sections, "tiles": dict(sorted(tiles.items())),
            **{k: metadata[k] for k in _TRAILING_METADATA if k in metadata}}


def write_table(table: dict, path: Path) -> Path:
    """Write ``table`` (:func:`table_json`) to ``path``: one key a line, sections in the order they were made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def read_table(path, target_name: str) -> dict[Bucket, AttentionConfig]:
    """The rows of the table at ``path`` (a file or an ``importlib.resources`` one) for ``target_name``.

    Raises
    ------
    ValueError
        Naming the file, for anything but a format-:data:`TABLE_FORMAT` table of ``target_name`` whose every tile
        is well formed and named by a row, and whose every row names its shared tile and its decode (``l1``) or
        chunk tile.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: expected a format-{TABLE_FORMAT} tile table as JSON, got unreadable text "
                         f"({type(e).__name__}: {e})") from None
    try:
        return table_rows(data, target_name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def table_rows(data, target_name: str) -> dict[Bucket, AttentionConfig]:
    """The rows of a table already parsed from JSON (:func:`read_table` without the file)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a format-{TABLE_FORMAT} tile table (a JSON object), got {type(data).__name__}")
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"expected a format-{TABLE_FORMAT} tile table (sections {', '.join(_REQUIRED_KEYS[2:])}), "
                         f"got format {data.get('format')!r}")
    if data.get("target") != target_name:
        raise ValueError(f"expected the table of target {target_name!r}, got one for {data.get('target')!r}")
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    unknown = sorted(set(data) - set(_REQUIRED_KEYS) - set(METADATA_KEYS))
    if missing or unknown:
        raise ValueError(f"expected the sections {', '.join(_REQUIRED_KEYS)} (and any of {', '.join(METADATA_KEYS)}), "
                         f"got {'no ' + ', '.join(missing) if missing else ''}"
                         f"{' and ' if missing and unknown else ''}{'unknown ' + ', '.join(unknown) if unknown else ''}")
    tiles = {name: _tile(name, raw) for name, raw in _object(data, "tiles").items()}
    names = {cls: {_bucket(cls, key): _name(cls, key, name, tiles) for key, name in _object(data, cls).items()}
             for cls in (SHARED, CHUNK, DECODE)}
    for cls in (CHUNK, DECODE):
        wrong = [b.key() for b in names[cls] if suffix_class(b) != cls]
        if wrong:
            what = "one query token per request (l1)" if cls == DECODE else "more query tokens per request (l2 on)"
            raise ValueError(f"{cls}: expected buckets of {what}, got {', '.join(wrong)}")
    suffixes = {**names[CHUNK], **names[DECODE]}
    if set(names[SHARED]) != set(suffixes):
        odd = sorted(set(names[SHARED]) ^ set(suffixes))
        raise ValueError(f"expected every row in {SHARED} and in {DECODE} or {CHUNK}, got "
                         f"{', '.join(b.key() for b in odd)} in one only")
    unused = sorted(set(tiles) - set(names[SHARED].values()) - set(suffixes.values()))
    if unused:
        raise ValueError(f"tiles: expected only tiles a row names, got unnamed {', '.join(unused)}")
    packed = sorted({n for n in names[SHARED].values() if tiles[n][0].kv_heads != 1} |
                    {n for n in names[CHUNK].values() if tiles[n][0].kv_heads != 1})
    if packed:
        raise ValueError(f"{SHARED}, {CHUNK}: expected tiles of one KV head per program (kv_heads is a decode "
                         f"tile's), got {', '.join(packed)}")
    return {bucket: _row(tiles[names[SHARED][bucket]], tiles[suffixes[bucket]]) for bucket in names[SHARED]}


def _object(data: dict, key: str) -> dict:
    if not isinstance(data[key], dict):
        raise ValueError(f"{key}: expected a JSON object, got {type(data[key]).__name__}")
    return data[key]


def _bucket(cls: str, key: str) -> Bucket:
    try:
        bucket = Bucket.from_key(key)
    except ValueError as e:
        raise ValueError(f"{cls}: {e}") from None
    if bucket.key() != key:  # leading zeros: two keys of one bucket would shadow each other
        raise ValueError(f"{cls}: expected bucket keys as Bucket.key() writes them, got {key!r} for {bucket.key()!r}")
    return bucket


def _name(cls: str, key: str, name, tiles: dict) -> str:
    if name not in tiles:
        raise ValueError(f"{cls}.{key}: expected the name of a tile in tiles, got {name!r}")
    return name


def _tile(name: str, raw) -> tuple[Tiles, LaunchOptions]:
    """One tile of the ``tiles`` section, checked, and its name checked against what it holds."""
    expected = "{block_m, block_n, launch: {num_warps, num_stages, ...}} (and kv_heads, optional)"
    if (not isinstance(raw, dict) or not {"block_m", "block_n", "launch"} <= set(raw) <= _TILE_KEYS
            or not isinstance(raw["launch"], dict)):
        raise ValueError(f"tiles.{name}: expected {expected}, got {raw!r}")
    try:
        launch = LaunchOptions(**raw["launch"])
    except TypeError as e:
        raise ValueError(f"tiles.{name}.launch: expected the fields of LaunchOptions, got {raw['launch']!r} ({e})") \
            from None
    tiles = Tiles(block_m=raw["block_m"], block_n=raw["block_n"], kv_heads=raw.get("kv_heads", 1))
    check_tiles(tiles, f"tiles.{name}")
    check_launch(launch, f"tiles.{name}.launch")
    if launch.maxnreg:
        raise ValueError(f"tiles.{name}.launch.maxnreg: expected none (the launch rules set it, never a table), "
                         f"got {launch.maxnreg!r}")
    if tile_name(tiles, launch) != name:
        raise ValueError(f"tiles.{name}: expected the name to say what the tile holds, {tile_name(tiles, launch)!r}")
    return tiles, launch


def _row(shared: tuple[Tiles, LaunchOptions], suffix: tuple[Tiles, LaunchOptions]) -> AttentionConfig:
    """A row as the lookup ranks it: the shared tile under ``launch``, the decode or chunk tile under
    ``suffix_launch`` (None when it is the same)."""
    return AttentionConfig(shared=shared[0], suffix=suffix[0], launch=shared[1],
                           suffix_launch=None if suffix[1] == shared[1] else suffix[1])
