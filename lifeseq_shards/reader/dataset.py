"""The dataset: its configuration (from the manifest and the arguments), its epoch plan's queries, and
``__iter__``, which composes the stages for this rank and worker.

The :class:`~.launch.World` (rank and world size) is fixed at construction in the launching process, so spawned
DataLoader workers (where ``torch.distributed`` is not initialised and RANK is unset) cannot lose it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from ..plan import order as plan_order
from ..plan.epoch import EpochPlan, plan_kind
from ..plan.partition import EVEN, Partition
from ..plan.resume import Arrangement, Leg, Position
from ..store.lengths import split_lengths
from ..store.manifest import MANIFEST, Manifest, ManifestError
from ..store.remote import dataset_url, read_manifest, require_block_checks
from .collate import BatchSpec
from .control import EpochControl
from .launch import World
from .options import ReadOptions, read_options
from .stages import load_windows, messages, sized_batches, slot_windows, with_shard_field
from .transport import RingWriter, WorkerLink, exit_with


class ShardedDataset(IterableDataset):
    """Collated batches of one split, each person at most once per epoch across all ranks and workers.

    ``mode="balanced"`` (training): every rank yields the same number of batches; the remainder shard is shared out
    too, and the fewer than ranks x workers persons that do not divide among the readers are left out (others each
    epoch: none two epochs running). ``mode="exact"`` (validation): every person exactly once, remainder included,
    and the same number of batches on every rank; an arrangement where that cannot be had is refused here, saying what
    to change. ``mode="complete"`` (inference): every person exactly once, remainders included; ranks may yield
    different numbers of batches; never shuffled. ``split`` may name several splits in complete and exact mode
    (e.g. ``("train", "val")`` to embed everyone); in complete mode ``skip_files`` leaves out shards by manifest
    path (a resumed embedding job's finished ones) and ``shard_field=True`` gives each batch a ``shard`` field, each
    person's shard as its position among the manifest's (``Manifest.entries()``).

    ``world``: this process's rank of the ranks that split the data (default :meth:`World.current`: torch.distributed,
    else the launcher's variables). ``window``: the persons loaded and shuffled together (default the larger of
    4,096 and two shards' persons). ``manifest``: the dataset's manifest when the caller has read it already
    (``LifeSeqDataModule`` reads it once for all its loaders); read from ``path`` otherwise. The plan's settings
    (``world_size``, ``num_workers``, ``batch_size``, ``drop_last``, ``mode``, ``seed``, ``shuffle``, ``window``)
    are read from :attr:`partition`.

    ``tokens_per_batch`` (training only): instead of ``batch_size`` persons, each rank's batch holds as many persons
    as fit in that many real tokens (each person counted up to ``crop``, the tokens the model sees when the device
    crops, else ``pad_to``), the ranks of a step balanced by ``balance`` (``"tokens"``, or ``"attention"``:
    the sum of len^2), planned offline from every person's length (:mod:`lifeseq_shards.plan.tokens`): every person
    of the split once an epoch (nobody left out), the same steps on every rank. ``batch_size`` then plays no part in
    this dataset (a front end's validation and predict loaders still read ``batch_size`` persons a batch).

    What it reads and how is one frozen :class:`~.options.ReadOptions` (:attr:`options`): ``options``, default
    ``ReadOptions()``, with ``settings`` (its fields by name, e.g. ``split="val", batch_size=64``) replacing what they
    name; code that builds several datasets builds the options once. ``ShardedDataset(path, "train", 256)`` (split
    and batch size by position) still reads so, warning: name them.

    Use with :class:`ShardedLoader` (or ``DataLoader(ds, batch_size=None, num_workers=ds.num_workers)``).
    ``len()`` is the exact number of batches this rank yields per epoch.
    """

    def __init__(self, path: str | os.PathLike[str], options: ReadOptions | None = None, *legacy: Any,
                 world: World | None = None, manifest: Manifest | None = None, **settings: Any) -> None:
        super().__init__()
        options = read_options(options, legacy, settings)
        self.options = options
        self.root = str(path) if str(path).startswith("pipe:") else str(path).rstrip("/")
        if world is not None and not isinstance(world, World):
            raise TypeError(f"world must be a lifeseq_shards.reader.World(rank, size), not {world!r}")
        self.world = World.current() if world is None else world
        self.split = options.split
        splits = options.splits

        # -- the manifest (read here unless the caller has): schema, fingerprint, the shards this mode reads -------
        self.manifest = read_manifest(self.root) if manifest is None else manifest
        missing = [s for s in splits if s not in self.manifest.splits]
        if missing or not splits:
            raise ValueError(f"{self.root}: no split {missing or splits!r} (has {', '.join(self.manifest.splits)})")
        self.schema = self.manifest.schema
        self.offline_mlm = self.manifest.offline_mlm
        if not self.manifest.fingerprint_matches:
            raise ManifestError(f"{dataset_url(self.root, MANIFEST)}: fingerprint does not match its schema and shard "
                                "checksums (edited by hand?); `shardify verify` checks the rest")
        self.fingerprint = self.manifest.fingerprint
        # balanced: the equal shards, and the remainder shard (number len(sizes)) shared out apart from them
        entries = [e for name in splits for e in self.manifest.splits[name].entries()
                   if e.file not in options.skip_files]
        # shard_field: each person's shard as its position among all the manifest's shards (SHARD_FIELD)
        position = {e.file: i for i, (_, e) in enumerate(self.manifest.entries())}
        self.shard_ids = [position[e.file] for e in entries] if options.shard_field else None
        self.shards = [self.manifest.shard_file(e, dataset_url(self.root, e.file)) for e in entries]
        require_block_checks(self.manifest, self.shards, self.root)
        if options.mode == EVEN:
            self._check_one_size(splits[0])
            info = self.manifest.splits[splits[0]]
            self.sizes, remainder = [e.samples for e in info.shards], info.remainder_persons
        else:
            self.sizes, remainder = [e.samples for e in entries], 0

        window = options.window if options.window is not None else plan_order.default_window(self.sizes)
        self.partition = Partition(tuple(self.sizes), self.world.size, options.num_workers, options.mode,
                                        options.seed, options.shuffled, options.batch_size, options.drop_last, window,
                                        remainder)
        self._link = WorkerLink(owner=os.getpid())  # until a loader attaches its own
        self.plan = self._epoch_plan()
        try:  # exact mode and a budget refuse an arrangement here, not in a worker
            len(self)
        except ValueError as e:
            raise ValueError(f"{self.root}: split {self.split}: {e}") from None
        batch_schema = with_shard_field(self.schema) if options.shard_field else self.schema
        self.spec = BatchSpec(batch_schema, options.packed, options.pad_multiple, options.pad_to, self.offline_mlm,
                              self.root)
        self._control = EpochControl(options.num_workers)
        self._ring_writer: RingWriter | None = None  # this worker's, kept across its passes
        self._warn_static_balance()

    def _epoch_plan(self) -> EpochPlan:
        """The plan of this dataset's epochs, of the kind its options ask for; the split's lengths (in the split's
        order, as self.shards lists them) are read only by a plan that plans from them."""
        asked = self.options.asked
        return plan_kind(asked).reading(asked, self.partition, self.rank, self._arrangement(),
                                        f"{self.root}: split {self.split}",
                                        lambda: split_lengths(self.root, self.manifest, self.options.splits[0]))

    # -- the plan: its settings are the partition's, stored there only -------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.partition.world_size

    @property
    def num_workers(self) -> int:
        return self.partition.num_workers

    @property
    def batch_size(self) -> int:
        return self.partition.batch_size

    @property
    def drop_last(self) -> bool:
        return self.partition.drop_last

    @property
    def mode(self) -> str:
        return self.partition.mode

    @property
    def seed(self) -> int:
        return self.partition.seed

    @property
    def shuffle(self) -> bool:
        return self.partition.shuffle

    @property
    def packed(self) -> bool:
        """Whether the batches are packed host batches (one buffer of real tokens; ``packed=True``)."""
        return self.spec.packed

    @property
    def window(self) -> int:
        """Persons loaded and shuffled together (by default max(4,096, 2 x the largest shard's))."""
        return self.partition.window

    def _check_one_size(self, split: str) -> None:
        """Balanced mode deals shards of one size: a manifest count that differs from the others (edited, or not
        this package's) is refused naming the manifest and the shard, before the plan refuses it naming neither.
        (Counts that agree with each other but not with the files are refused by the read, naming the shard.)"""
        info = self.manifest.splits[split]
        sizes = [e.samples for e in info.shards]
        if len(set(sizes)) < 2:
            return
        common = info.shard_persons if info.shard_persons in sizes else max(set(sizes), key=sizes.count)
        odd = next(e for e in info.shards if e.samples != common)
        raise ManifestError(f"{dataset_url(self.root, MANIFEST)}: split {split}: shard {odd.file} counts "
                            f"{odd.samples} persons, the split's other shards {common} each: the manifest was edited, "
                            "or is not one `shardify convert` wrote; `shardify verify` checks it against the files")

    @property
    def tokens_per_batch(self) -> int | None:
        """The token budget of a rank's batch (None: batches of ``batch_size`` persons)."""
        return self.options.tokens_per_batch

    @property
    def batch_persons(self) -> int:
        """Persons of a typical batch: ``batch_size``, or the persons a budget holds on average."""
        return self.plan.batch_persons

    def _warn_static_balance(self) -> None:
        """Say once a job, on rank 0 (every rank has the same arrangement), when the workers do not divide the shards as
        converted, and which worker counts would."""
        said = self.plan.shard_warning() if self.rank == 0 else None
        if said:
            warnings.warn(f"{self.split}: {said}", stacklevel=3)

    def per_worker_batches(self) -> list[int]:
        """Batches each worker of this rank yields per epoch (the same every epoch)."""
        return self.plan.worker_batches()

    def __len__(self) -> int:
        return sum(self.per_worker_batches())

    # -- epochs and resume ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` (the one after it ``epoch + 1``, ...); reaches persistent workers."""
        self.resume_at(epoch, 0)

    def resume_at(self, epoch: int, batches: int, history: Sequence[Leg] = (),
                  left_out_before: Sequence[int] = ()) -> None:
        """The next pass is ``epoch``, skipping the first ``batches`` batches the loader had returned; with a
        ``history``, the legs that read its start in other arrangements, ``batches`` counts from the start of this
        arrangement's epoch (:class:`plan_resume.RestPlan`'s ``base`` on); ``left_out_before``: the persons the epoch
        before left out that this one reads (``Position.left_out_before``). Refused outside the epoch (a negative
        epoch, or more batches than this rank's ``len()``): the pass would be empty or fail in the workers, not say
        why."""
        at = Position(epoch, batches, tuple(history), tuple(left_out_before))
        if epoch < 0:
            raise ValueError(f"{self.root}: epoch {epoch}: epochs are numbered from 0")
        first = self.plan.first_batch(at)
        if not first <= batches <= len(self):
            raise ValueError(f"{self.root}: cannot resume epoch {epoch} after {batches} batches: this rank's epoch "
                             f"has {len(self)} (resume at {first}..{len(self)}, or set_epoch({epoch + 1}) for the "
                             "next)")
        self._control.set_epoch(at)

    def next_position(self, worker: int = 0) -> Position:
        """Where ``worker``'s next pass starts (worker 0's: the loader's next pass), as the workers compute it: the
        loaded position, else the start of a later epoch (:func:`plan_resume.next_epoch`)."""
        return self.plan.pass_position(self._control.loaded(), self._control.passes(worker))

    def after(self, at: Position, epoch_batches: int) -> Position:
        """Where the pass after ``at`` resumes: ``at`` itself until its epoch's ``epoch_batches`` are taken, then
        the next epoch's start (:meth:`EpochPlan.after`)."""
        return self.plan.after(at, epoch_batches)

    @property
    def arrangement(self) -> Arrangement:
        """This dataset's readers, as a leg of an epoch records them."""
        return self.plan.arrangement

    def _arrangement(self) -> Arrangement:
        """The readers of the partition, with the loader's batches per message and the budget."""
        return Arrangement.of_partition(self.partition, self.batches_per_message if self.num_workers else 1,
                                   self.options.tokens_per_batch or 0)

    # -- the loader's side ------------------------------------------------------------------------------------
    def attach(self, link: WorkerLink) -> None:
        """Take a loader's message size, rings and owner process (:class:`ShardedLoader` calls it before its
        workers start)."""
        self._link = link
        self.plan = self.plan.arranged(self._arrangement())

    @property
    def batches_per_message(self) -> int:
        return self._link.batches_per_message

    @property
    def rings(self) -> torch.Tensor | None:
        return self._link.rings

    @property
    def ring_ctl(self) -> torch.Tensor | None:
        return self._link.ring_ctl

    # -- iteration --------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, k = (0, 0) if info is None else (info.id, info.num_workers)
        if info is not None:
            exit_with(self._link.owner)
        if k != self.num_workers:
            raise RuntimeError(
                f"ShardedDataset was built for num_workers={self.num_workers} but runs in a DataLoader with "
                f"num_workers={k}: the plan would overlap or miss persons. Pass the same num_workers to both "
                "(ShardedLoader does it for you)."
            )
        at = self.plan.pass_position(self._control.loaded(), self._control.claim_pass(worker))
        read = self.plan.read(at, worker)
        per_message = self.arrangement.batches_per_message
        stages: list[Any] = [
            lambda: slot_windows(read),
            lambda src: load_windows(src, self.shards, self.schema, self.shard_ids),
            lambda src: sized_batches(src, self.spec, read.sizes, read.drop_last),
        ]
        writer = self._writer(worker)
        if per_message > 1 or writer is not None:
            stages.append(lambda src: messages(src, per_message, read.skip, writer))
        return iter(wds.DataPipeline(*stages))

    def _writer(self, worker: int) -> RingWriter | None:
        """This worker's ring writer, set for a new pass; None without rings (no workers, or batches not packed)."""
        link = self._link
        if link.rings is None or link.ring_ctl is None:
            return None
        if self._ring_writer is None:
            self._ring_writer = RingWriter(link.rings, link.ring_ctl, worker)
        self._ring_writer.new_pass()
        return self._ring_writer
