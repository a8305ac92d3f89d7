"""The end of `make demo`: read a few batches as rank 0 of 2 with 2 workers, then build the seed's batch with
dynamic MLM masks (on the CPU here; on the GPU in training) and show what crosses the bus."""

from __future__ import annotations

import sys

import torch

from lifeseq_shards import ShardedDataset, ShardedLoader
from lifeseq_shards.device import model_batch, packed_views, to_device
from lifeseq_shards.masking import DynamicMasker, MaskingConfig


def main(root: str, batches: int = 3) -> None:
    """Rank 0 of 2 with 2 workers: packed batches, then the model's batch built from each."""
    ds = ShardedDataset(root, "train", batch_size=64, rank=0, world_size=2, num_workers=2, packed=True)
    masker = DynamicMasker(MaskingConfig(vocab_size=int(ds.manifest.vocab_size), seed=0))
    print(f"rank 0 of 2, 2 workers: {len(ds)} batches per epoch")
    for i, batch in enumerate(ShardedLoader(ds)):
        if i == batches:
            break
        fields = packed_views(batch)
        model = model_batch(to_device(batch, "cpu"), masker, epoch=0)
        wide = sum(t.nbytes for t in model.values())
        print(f"batch {i}: persons {len(fields['person_id'])}, real tokens {int(fields['lengths'].sum())}, padded "
              f"on the device to {batch.width}; crosses the bus as one {batch.nbytes / 1024:.0f} KiB "
              f"buffer ({', '.join(f'{k}:{str(v.dtype)[6:]}' for k, v in fields.items())})")
        print(f"   model batch on device {wide / 1024:.0f} KiB: "
              + ", ".join(f"{k}{tuple(v.shape)}" for k, v in model.items() if isinstance(v, torch.Tensor)))
        masked = (model["input_ids"][:, 0] == 3).sum().item() / model["padding_mask"].sum().item()
        cls = torch.bincount(model["target_cls"], minlength=3).tolist()
        print(f"   [MASK] share of real tokens {masked:.3f}, target_cls counts {cls}")


if __name__ == "__main__":
    main(sys.argv[1])
