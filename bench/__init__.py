"""Benchmarks of specmesh against plain and HF speculative generation (run: make bench)."""
