"""Benchmarks behind `p2pkv bench ...`: each prints a table of figures measured in the same run."""
