"""Benchmark programs. Each prints a table and ends with one JSON line; each checks that what it
timed is exact. They are programs, not timed tests."""
