"""Benchmarks and device scripts. Run them from the repository root as ``python -m tools.NAME`` (the working tree's
``lifeseq_shards`` then comes first); they share code by importing ``tools.NAME``."""
