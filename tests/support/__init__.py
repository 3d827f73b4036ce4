"""Helpers for the tests only, imported as `tests.support.<module>` from the repository root.
What the benchmarks share with the tests lives in `devtools/`."""
