"""Benchmarks: `ridgeline bench serve | throughput | overhead`."""
