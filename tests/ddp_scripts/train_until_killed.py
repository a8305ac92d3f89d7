"""Reads batches through 2 forkserver workers (shared-memory rings) until killed; says READY once they run.

tests/reader/test_reader.py SIGKILLs it, as an out-of-memory kill would, and checks that nothing it started
outlives it or keeps its stdout open."""

import sys
import time

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World

if __name__ == "__main__":
    loader = ShardedLoader(ShardedDataset(sys.argv[1], batch_size=64, num_workers=2, packed=True, world=World(0, 1)))
    seen = 0
    while True:
        for _batch in loader:
            seen += 1
            if seen == 5:
                print("READY", flush=True)
            time.sleep(0.01)
