"""Tests of the benchmarks (benchmarks/), apart from the library's."""
