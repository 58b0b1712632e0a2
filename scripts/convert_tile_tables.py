"""One-off: convert the shipped tile tables (prefixattn/autotune/configs/<target>[.measured].json) from format 1 to
format 2 (prefixattn.autotune.tables), in place. Run once; its output is committed and the script removed after it.

    python scripts/convert_tile_tables.py

Format 1 maps each bucket key to a config by name (``configs``: shared/suffix tiles, launch, suffix_launch). Each row
becomes its shared tile under its launch and its suffix tile under its suffix-only launch, in the decode (l1) or
chunk section; the metadata (source, device, notes, compile-check exclusions) is carried over. Every converted table
is read back with the format-2 reader and must give each bucket the same tiles and launches as the format-1 row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefixattn.autotune.buckets import Bucket  # noqa: E402
from prefixattn.autotune.config_space import AttentionConfig  # noqa: E402
from prefixattn.autotune.tables import METADATA_KEYS, read_table, table_json, write_table  # noqa: E402

CONFIGS = ROOT / "prefixattn" / "autotune" / "configs"
OLD_FORMAT = 1


def old_rows(data: dict, path: Path) -> dict:
    """Format 1's rows: bucket -> config."""
    if data.get("format") != OLD_FORMAT:
        raise ValueError(f"{path}: expected format {OLD_FORMAT}, got {data.get('format')!r}")
    unknown = set(data) - {"format", "target", "configs", "buckets"} - set(METADATA_KEYS)
    if unknown:
        raise ValueError(f"{path}: keys the conversion would drop: {sorted(unknown)}")
    configs = {name: AttentionConfig.from_dict(c) for name, c in data["configs"].items()}
    unused = set(configs) - set(data["buckets"].values())
    if unused:
        print(f"{path.name}: configs no bucket names (dropped): {sorted(unused)}")
    return {Bucket.from_key(key): configs[name] for key, name in data["buckets"].items()}


def live(cfg: AttentionConfig) -> tuple:
    """What a lookup of the row can hand on: each tile and the launch it runs under."""
    return cfg.shared, cfg.launch_for(True), cfg.suffix, cfg.launch_for(False), cfg.short()


def main() -> int:
    for path in sorted(CONFIGS.glob("*.json")):
        if path.name.endswith(".program_cost.json"):
            continue  # the program-cost calibration: another file, another format
        data = json.loads(path.read_text())
        target = data["target"]
        rows = old_rows(data, path)
        metadata = {k: data[k] for k in METADATA_KEYS if k in data}
        write_table(table_json(rows, target=target, **metadata), path)
        back = read_table(path, target)
        assert set(back) == set(rows), path
        assert all(live(back[b]) == live(rows[b]) for b in rows), path
        new = json.loads(path.read_text())
        print(f"{path.name}: {len(rows)} rows, {len(data['configs'])} configs -> {len(new['tiles'])} tiles "
              f"({', '.join(f'{c} {len(new[c])}' for c in ('shared', 'chunk', 'decode'))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
