"""Helpers for tests and benchmarks (tiny random models)."""
