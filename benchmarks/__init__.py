"""Benchmarks of mmfsdp: measured costs, never timed tests."""
