"""Benchmarks and device scripts. Run them from the repository root as ``python -m tools.NAME`` (the working tree's
``lifeseq_shards`` then comes first). What more than one of them uses is ``tools.common``; a tool imports no other
tool."""
