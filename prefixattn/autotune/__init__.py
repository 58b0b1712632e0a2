"""Tile configurations per GPU target: config spaces, lookup, tuning cache and ahead-of-time compile checks."""
