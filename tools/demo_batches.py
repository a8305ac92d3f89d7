"""The end of `make demo`: read a few batches as rank 0 of 2 ranks with 2 workers each, build the model's batch with
dynamic MLM masks from each (on the CPU here; on the GPU in training), and say what every number means and what a
correct run shows."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from lifeseq_shards import ShardedDataset, ShardedLoader
from lifeseq_shards.device.build import model_batch, packed_views, to_device
from lifeseq_shards.masking import MASK, DynamicMasker, MaskingConfig
from lifeseq_shards.reader import World

SEED_BYTES_PER_SLOT = 48  # the seed's int64 batch: input_ids 4 x 8 bytes, padding_mask and original_sequence 8 each


def share(part: int, whole: int) -> str:
    return f"{100 * part / max(whole, 1):.1f} %"


@dataclass
class Tally:
    """The MLM targets by how they are shown, and the persons by CLS class, summed over batches."""

    targets: int = 0
    masked: int = 0
    kept: int = 0
    cls: list[int] = field(default_factory=lambda: [0, 0, 0])

    def add(self, targets: int, masked: int, kept: int, cls: list[int]) -> None:
        self.targets, self.masked, self.kept = self.targets + targets, self.masked + masked, self.kept + kept
        self.cls = [a + b for a, b in zip(self.cls, cls, strict=True)]

    def shares(self) -> str:
        n = self.targets
        return (f"targets shown as [MASK] {share(self.masked, n)} (expect 80-83 %), kept {share(self.kept, n)} "
                f"(8-10 %), random {share(n - self.masked - self.kept, n)} (8-10 %); persons whose events were "
                f"reversed or shuffled {share(self.cls[1] + self.cls[2], sum(self.cls))} (~10 %)")


def main(root: str, batches: int = 3, workers: int = 2) -> None:
    """Rank 0 of 2 with ``workers`` workers: packed host batches, then the model's batch built from each."""
    ranks, batch_size = 2, 64
    ds = ShardedDataset(root, split="train", batch_size=batch_size, world=World(0, ranks), num_workers=workers,
                        packed=True)
    cfg = MaskingConfig(vocab_size=int(ds.manifest.vocab_size), seed=0)
    masker = DynamicMasker(cfg)
    print(f"Reading the train split as rank 0 of {ranks} ranks x {workers} workers, batches of {batch_size}, with "
          f"the seed's dynamic MLM rules (ratio {cfg.ratio}, keep {cfg.keep}, [MASK] {cfg.mask}, random "
          f"{cfg.random_share:.1f}; CLS task: reversed {cfg.p_reverse}, shuffled {cfg.p_shuffle}).")
    print(f"  batches per epoch on this rank: {len(ds)}  (every rank gets exactly as many: `shardify plan` above "
          "printed the same number)")
    tally = Tally()
    for i, batch in enumerate(ShardedLoader(ds)):
        if i == batches:
            break
        fields = packed_views(batch)
        lengths = fields["lengths"].long()
        model = model_batch(to_device(batch, "cpu"), masker, epoch=0)
        persons, width = model["padding_mask"].shape
        real = int(lengths.sum())
        bus = sum(v.nbytes for v in fields.values())
        print(f"batch {i}")
        print(f"  persons: {persons}  (the batch size, {batch_size}; only a worker's last batch may be shorter)")
        print(f"  real tokens: {real:,}  (the sum of the persons' lengths, {real / persons:.0f} a person)")
        print(f"  host -> device: {bus / 1024:.0f} KiB in one narrow buffer ({', '.join(fields)}), "
              f"{bus / real:.1f} bytes a real token  (the seed's int64 batch: {SEED_BYTES_PER_SLOT} bytes a padded "
              "slot; expect a few bytes a token)")
        print(f"  model batch on the device: input_ids {tuple(model['input_ids'].shape)} = (persons, tokens / abspos "
              f"/ age / segment, width); width {width} = the longest person, rounded up to a multiple of 8")
        target_tokens, target_pos = model["target_tokens"], model["target_pos"]
        used = target_tokens > 0  # an unused target column holds token 0 ([PAD])
        shown = model["input_ids"][:, 0].gather(1, target_pos)
        expected = int(torch.minimum((0.3 * lengths).floor().long(), lengths).sum())
        n, masked = int(used.sum()), int((used & (shown == MASK)).sum())
        kept = int((used & (shown == target_tokens)).sum())
        cls = torch.bincount(model["target_cls"], minlength=3).tolist()
        print(f"  MLM targets: {n:,}  (floor(0.3 x length) a person: expect {expected:,}, fewer only for a person "
              "with too few ordinary tokens)")
        print(f"    shown as [MASK]: {share(masked, n)}, kept as they are: {share(kept, n)}, a random token: "
              f"{share(n - masked - kept, n)}  (BERT's 80/10/10 rule, floor(0.1 x targets) kept and as many random "
              "a person: a little over 80 % [MASK], a little under 10 % each)")
        print(f"  CLS task (target_cls): {cls[0]} original, {cls[1]} events reversed, {cls[2]} shuffled  (expect "
              f"about {100 * (1 - cfg.p_reverse - cfg.p_shuffle):.0f} / {100 * cfg.p_reverse:.0f} / "
              f"{100 * cfg.p_shuffle:.0f} % of the persons)")
        tally.add(n, masked, kept, cls)
    print(f"over these {batches} batches: {tally.shares()}")


if __name__ == "__main__":
    main(sys.argv[1])
