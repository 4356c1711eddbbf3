"""Benchmark harness behind `laneserve bench` (not serving code)."""
