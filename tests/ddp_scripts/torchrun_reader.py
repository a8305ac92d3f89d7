"""Run under torchrun: read the train split for some epochs with ShardedDataset + ShardedLoader and report, per rank,
the person ids of every batch, len(loader), and the loader's state_dict taken after ``--snapshot-at`` batches of the
first epoch. ``--resume FILE`` restarts from rank 0's snapshot in an earlier run's output (any number of ranks,
workers, batch size or token budget: the rest of that epoch, then whole epochs)."""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from gather import finish, gather_to_json

from lifeseq_shards.reader import ShardedDataset, ShardedLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--snapshot-at", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--tokens-per-batch", type=int, default=None, help="a token budget instead of --batch-size")
    args = p.parse_args()

    dist.init_process_group("gloo")
    # rank and world size are deliberately not passed: the dataset must take them from torch.distributed
    loader = ShardedLoader(ShardedDataset(args.data, split="train", batch_size=args.batch_size,
                                          num_workers=args.workers, tokens_per_batch=args.tokens_per_batch))
    if args.resume:
        with open(args.resume) as fh:
            # rank 0's, as Lightning's checkpoint holds: the state has no per-rank part, and the world may differ
            loader.load_state_dict(json.load(fh)["ranks"][0]["snapshot"])
    epochs, snapshot = [], None
    for e in range(args.epochs):
        batches = []
        for batch in loader:
            batches.append(batch["person_id"].tolist())
            if e == 0 and len(batches) == args.snapshot_at:
                snapshot = loader.state_dict()
        epochs.append(batches)
    ds = loader.dataset
    gather_to_json({"rank": ds.rank, "world_size": ds.world_size, "len": len(loader), "epochs": epochs,
                    "snapshot": snapshot}, args.out)
    finish()


if __name__ == "__main__":
    main()
