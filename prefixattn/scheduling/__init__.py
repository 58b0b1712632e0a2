"""Global prefix scheduler (numpy only): prefix tree, grouping, ordering, token batching."""
