"""Throughput simulator: hardware/model presets, cost model, iteration-level engine, workloads."""
