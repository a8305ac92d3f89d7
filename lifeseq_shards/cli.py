"""``shardify``: a thin click layer over the library. Exit 0 success, 1 verify/upgrade/plan found problems, 2 bad
input."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .store.format import MIN_SHARD_PERSONS

if TYPE_CHECKING:
    import numpy as np

    from .plan.asked import Asked
    from .store.manifest import Manifest

POSITIVE, COUNT = click.IntRange(min=1), click.IntRange(min=0)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class _Group(click.Group):
    """Usage errors exit 2 (click's default); library errors become one line and exit 2 too."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a bad option: one line too, naming the option
            _fail(e.format_message())
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own flow (--help, ^C) loads none of the library's errors
        except Exception as e:
            if not isinstance(e, _library_errors()):
                raise
            _fail(str(e))


def _library_errors() -> tuple[type[Exception], ...]:
    """The errors that become one line; imported only once one is raised, so that ``--help`` loads no converter and
    no I/O edge."""
    from .convert.passes import ConvertError
    from .convert.sources import SourceError
    from .embed.store import EmbeddingsError
    from .store.manifest import ManifestError
    from .store.remote import RemoteSettingError
    from .store.writes import WriteFailed

    return (ConvertError, SourceError, ManifestError, RemoteSettingError, EmbeddingsError, WriteFailed,
            FileNotFoundError)


@click.group(cls=_Group)
@click.version_option(package_name="lifeseq-shards", prog_name="shardify")
def main() -> None:
    """Convert life-event sequences into exact, DDP-ready tar shards; verify, inspect and plan them; check and merge
    embeddings."""


def _dtype_option(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        name, _, dtype = v.partition("=")
        if not dtype:
            raise click.BadParameter(f"{v!r}: expected FIELD=DTYPE, e.g. abspos=int32", param_hint="--dtype")
        out[name] = dtype
    return out


def _exit_on_problems(root: str, problems: list[str], consequence: str = "") -> None:
    """Each problem on its own line and exit 1, the count on stderr; nothing when there are none."""
    for p in problems:
        click.echo(p)
    if problems:
        click.echo(f"{root}: {len(problems)} problem(s){consequence}", err=True)
        sys.exit(1)


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Dataset directory to write.")
@click.option("--vocab", type=click.Path(),
              help="vocab.csv (TOKEN, CATEGORY, ID); required for parquet input; with .h5 input it records the "
              "vocabulary size in the manifest (LifeSeqDataModule's masking takes it from there).")
@click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="Share of persons for val.")
@click.option("--num-val", type=COUNT, help="Exactly this many persons for val (instead of --val-fraction).")
@click.option("--nodes", type=POSITIVE, help="Make the shard count a multiple of nodes x gpus x workers.")
@click.option("--gpus", type=POSITIVE, help="GPUs per node.")
@click.option("--workers", type=COUNT, help="DataLoader workers per GPU.")
@click.option("--shards", type=POSITIVE, help="Exactly this many shards per split.")
@click.option("--min-shard-persons", type=POSITIVE, default=MIN_SHARD_PERSONS, show_default=True,
              help="Without --shards: at least this many persons a shard.")
@click.option("--processes", type=POSITIVE, default=1, show_default=True, help="Conversion processes.")
@click.option("--seed", type=COUNT, default=0, show_default=True, help="Split and shuffle seed.")
@click.option("--max-seq-len", type=POSITIVE, default=512, show_default=True,
              help="Parquet input: a sequence keeps fewer tokens than this (the seed's cap).")
@click.option("--time-range-start", type=int, default=None, help="Drop events with abspos below this.")
@click.option("--time-range-end", type=int, default=16438, show_default=True, help="Drop events with abspos above.")
@click.option("--block-persons", type=POSITIVE, default=256, show_default=True, help="Persons per compressed block.")
@click.option("--zstd-level", type=click.IntRange(1, 22), default=9, show_default=True)
@click.option("--all", "with_all", is_flag=True, help="Also write an all/ split (every person) for inference.")
@click.option("--dtype", "dtypes", multiple=True,
              help="Override a field's integer dtype (tokens, length, abspos, age, segment), e.g. abspos=int32.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset in OUT.")
@click.option("--task", type=COUNT,
              help="Array conversion: write only task TASK's share of the shards (0-based; with --tasks), to merge "
              "with `shardify merge OUT`. Under a SLURM job array both default to the array's task.")
@click.option("--tasks", type=POSITIVE, help="Array conversion: the number of tasks (with --task).")
def convert(inputs: tuple[str, ...], out: str, vocab: str | None, dtypes: tuple[str, ...], task: int | None,
            tasks: int | None, **kw: object) -> None:
    """Convert INPUT files (step-4 .parquet with --vocab, or step-5 encoded .h5) into shards; or, as one task of a
    job array (--task/--tasks, or SLURM_ARRAY_TASK_ID), that task's share of them."""
    import os

    from .convert.array import convert_task, share_from
    from .convert.passes import ConvertOptions, convert_dataset

    _refuse_parquet_only(inputs)
    opts = ConvertOptions(dtypes=_dtype_option(dtypes), **kw)  # type: ignore[arg-type]
    share, origin = share_from(task, tasks, os.environ)
    if share is None:
        _summary(out, convert_dataset(list(inputs), out, vocab, opts))
        return
    part, now = convert_task(list(inputs), out, vocab, opts, share)
    shards = ", ".join(f"{k} {len(v.entries())}" for k, v in part.splits.items())
    state = "converted" if now else "already complete with these options, not converted again"
    click.echo(f"{out}: task {share.task} of {share.tasks} ({origin}) {state}: shards {shards}; once all "
               f"{share.tasks} are complete: shardify merge {out}")


def _summary(out: str, m: Manifest) -> None:
    """The dataset's splits, fingerprint and dropped rows (convert, merge)."""
    from .convert.sources import drops

    splits = ", ".join(f"{k} {v.persons:,} in {len(v.shards)} shards" for k, v in m.splits.items())
    click.echo(f"{out}: {m.totals.persons:,} persons ({splits}); fingerprint {m.fingerprint}")
    click.echo(f"{out}: {drops.summary(m.totals.dropped, m.totals.input_rows)}")


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset in OUT (as the tasks' --overwrite).")
def merge(out: str, overwrite: bool) -> None:
    """Merge the parts of an array conversion (`convert --task I --tasks K`) into the dataset OUT: refused (exit 2,
    naming the task) unless all K are complete and made from the same input and options; the shards are linked into
    place, not copied; a second merge does nothing."""
    from .convert.array import merge_tasks

    m, now = merge_tasks(out, overwrite)
    if not now:
        click.echo(f"{out}: already merged; nothing to do")
    _summary(out, m)


def _refuse_parquet_only(inputs: tuple[str, ...]) -> None:
    """An option given for .h5 input that only parquet input honours: refused, not ignored (an encoded file keeps
    its own width and events, so `--max-seq-len 256` would silently leave its sequences at 512)."""
    from .convert.sources import SourceError, input_kind

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("max_seq_len", "time_range_start", "time_range_end")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    try:
        h5 = all(input_kind(p) == "hdf5" for p in inputs)
    except SourceError:
        return  # an unknown kind: open_sources names it
    if given and h5:
        _fail(f"{inputs[0]}: {', '.join(given)} applies to parquet input only (an encoded .h5 keeps its own "
              "sequence width and events); drop it")


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--people", type=POSITIVE, required=True, help="Number of persons to generate.")
@click.option("--seed", type=COUNT, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace existing files in OUT.")
def synth(out: str, people: int, seed: int, overwrite: bool) -> None:
    """Write a synthetic population: OUT/sequences.parquet + OUT/vocab.csv (the step-4 form)."""
    from .convert.sources.synth import ID_BITS, synth_population

    if people > 1 << ID_BITS:
        _fail(f"--people {people}: at most {1 << ID_BITS} (person ids are {ID_BITS}-bit)")
    if (Path(out) / "sequences.parquet").exists() and not overwrite:
        _fail(f"{out}: already holds sequences.parquet; pass --overwrite to replace it")
    synth_population(out, people, seed)
    click.echo(f"{out}: {people:,} synthetic persons (seed {seed})")


@main.command()
@click.argument("root", type=click.Path())
def verify(root: str) -> None:
    """Re-hash every shard, decode every record, check them against the manifest."""
    from .convert.integrity import verify_dataset

    _exit_on_problems(root, verify_dataset(root))
    click.echo(f"{root}: OK")


@main.command()
@click.argument("root", type=click.Path())
def upgrade(root: str) -> None:
    """Verify a dataset of an older format, then add every block's checksum to its manifest (the reader checks each
    block it reads against it, and refuses a dataset without them) and a lengths index to each split without one
    (the token-budget plan reads it instead of every block). The shards and the fingerprint stay as they are."""
    from .convert.integrity import upgrade_dataset

    m, problems = upgrade_dataset(root)
    _exit_on_problems(root, problems, "; not upgraded (convert it again)")
    blocks = sum(len(e.block_checksums or ()) for _, e in m.entries())
    indexes = ", ".join(s.lengths.file for s in m.splits.values() if s.lengths)
    click.echo(f"{root}: OK; format {m.format_version} with the checksums of its {blocks} blocks and the lengths "
               f"indexes {indexes}")


@main.command()
@click.argument("root", type=click.Path())
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Also draw the persons' lengths as a histogram into this file (.png, .pdf, .svg).")
def inspect(root: str, plot: str | None) -> None:
    """Print a readable summary of a dataset."""
    from .convert.integrity import plot_lengths, summarize

    click.echo(summarize(root))
    if plot is not None:
        try:
            plot_lengths(root, plot)
        except (OSError, ValueError) as e:  # an unknown suffix (ValueError), an unwritable place
            _fail(f"{plot}: cannot draw the lengths there ({e})")
        click.echo(f"lengths      drawn in {plot}")


@main.command()
@click.argument("root", type=click.Path())
@click.option("--nodes", type=POSITIVE, default=1, show_default=True)
@click.option("--gpus", type=POSITIVE, default=1, show_default=True, help="GPUs (ranks) per node.")
# the front ends' default (LifeSeqDataModule, LifeSeqData): a plan without --workers is the run without num_workers=
@click.option("--workers", type=COUNT, default=2, show_default=True, help="DataLoader workers per GPU.")
@click.option("--batch-size", type=POSITIVE,
              help="Persons a rank a step (required without --tokens-per-batch; with it, the persons plan compared).")
@click.option("--tokens-per-batch", type=POSITIVE,
              help="Plan token-budget steps of at most this many real tokens a rank, beside the persons plan.")
@click.option("--attention", is_flag=True,
              help="With --tokens-per-batch: deal a step's persons to even out len^2 (attention's cost), not tokens.")
@click.option("--split", default="train", show_default=True)
@click.option("--drop-last", is_flag=True, help="Plan without the last partial batch of each worker.")
@click.option("--resume", "checkpoint", type=click.Path(dir_okay=False),
              help="A checkpoint (Lightning's, or a file of ShardedLoader.state_dict()): plan the rest of its epoch "
              "on this arrangement.")
def plan(root: str, nodes: int, gpus: int, workers: int, batch_size: int | None, tokens_per_batch: int | None,
         attention: bool, split: str, drop_last: bool, checkpoint: str | None) -> None:
    """Show which rank and worker reads what, and who is left out; exit 1 when the shards do not divide evenly
    (train), when validation cannot read every person of the split once in equal batches (any other split), or
    (with --resume) when someone is left out of the rest of the epoch. With --tokens-per-batch: the token-budget
    plan's steps and balance beside the persons plan's (exit 2 when the budget is refused)."""
    from .plan.asked import Asked, Topology
    from .plan.epoch import plan_kind
    from .plan.partition import EVEN, EXACT
    from .store.lengths import split_lengths
    from .store.remote import read_manifest

    asked = Asked(batch_size, tokens_per_batch, "attention" if attention else "tokens", drop_last=drop_last)
    if checkpoint is not None and (batch_size is not None or tokens_per_batch is not None):
        _refuse_flags(asked, split)  # the rest of the checkpoint's epoch: training's, whatever --split says
        _plan_resume(root, checkpoint, nodes * gpus, workers, batch_size, drop_last, tokens_per_batch, asked.balance)
    m = read_manifest(root)
    if split not in m.splits:
        _fail(f"{root}: no split {split!r} (has {', '.join(m.splits)})")
    info = m.splits[split]
    # train is read as training reads it; any other split as validation does (every person once)
    asked = dataclasses.replace(asked, mode=EVEN if split == "train" else EXACT)
    _refuse_flags(asked, split)

    def lengths() -> tuple[np.ndarray, list[int]]:
        """The split's lengths (from its lengths index, or its blocks in a dataset without one) and its shards'
        persons, the remainder last (an empty one without a remainder shard, as the plans take it)."""
        persons, sizes = split_lengths(root, m, split)
        return persons, sizes if info.remainder is not None else [*sizes, 0]

    report = plan_kind(asked).report(asked, Topology(nodes, gpus, workers), split,
                                     ([s.samples for s in info.shards], info.remainder_persons), lengths)
    click.echo(report.text)
    sys.exit(report.status)


def _refuse_flags(asked: Asked, split: str) -> None:
    """Refuse (exit 2) flags that would do nothing with the plan they ask for: `--attention` without a budget, a
    budget on a split read as validation reads it, no batch size of either kind."""
    from .plan.epoch import plan_kind

    said = plan_kind(asked).flag_refusal(asked, split)
    if said:
        _fail(said)


@main.command("time")
@click.argument("root", type=click.Path())
@click.option("--workers", "worker_counts", type=COUNT, multiple=True, default=(0, 2), show_default=True,
              help="DataLoader workers per rank; repeat the option to time several counts.")
@click.option("--batch-size", type=POSITIVE, default=256, show_default=True)
@click.option("--split", default="train", show_default=True)
@click.option("--nodes", type=POSITIVE, default=1, show_default=True, help="Read rank 0's share of this arrangement.")
@click.option("--gpus", type=POSITIVE, default=1, show_default=True, help="GPUs (ranks) per node.")
@click.option("--batches", type=POSITIVE, default=200, show_default=True, help="At most this many batches a pass.")
def time_reading(root: str, worker_counts: tuple[int, ...], batch_size: int, split: str, nodes: int, gpus: int,
                 batches: int) -> None:
    """Time a pass over ROOT as rank 0 reads it, per worker count: the first batch's latency, then persons and real
    tokens per second (the host side of the data path, before the GPU)."""
    from .reader import World
    from .store.remote import read_manifest
    from .timing import HEADER, time_pass

    m = read_manifest(root)
    if split not in m.splits:
        _fail(f"{root}: no split {split!r} (has {', '.join(m.splits)})")
    click.echo(f"{root} {split}: rank 0 of {nodes * gpus}, batch {batch_size}, at most {batches} batches a pass")
    click.echo(HEADER)
    for workers in worker_counts:
        click.echo(time_pass(root, split, batch_size, workers, World(0, nodes * gpus), batches, m).row())


def _plan_resume(root: str, checkpoint: str, world: int, workers: int, batch_size: int | None, drop_last: bool,
                 tokens_per_batch: int | None, balance: str) -> None:
    """`shardify plan --resume`: the rest of the checkpoint's epoch on this arrangement (reader/rest.py)."""
    from .reader.rest import RestRefused, rest_of_epoch

    try:
        text, code = rest_of_epoch(root, checkpoint, world, workers, batch_size, drop_last, tokens_per_batch, balance)
    except RestRefused as e:
        _fail(str(e))
    click.echo(text)
    sys.exit(code)


@main.group()
def embeddings() -> None:
    """Check and merge the output of an EmbeddingWriter (one Parquet file per input shard)."""


@embeddings.command("verify")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.option("--data", required=True, type=click.Path(file_okay=False, exists=True),
              help="The dataset that was embedded.")
def embeddings_verify(out: str, data: str) -> None:
    """Exit 0 only if every person of the embedded splits appears exactly once, whole and finite."""
    from .embed.check import verify_embeddings

    _exit_on_problems(out, verify_embeddings(out, data))
    click.echo(f"{out}: OK")


@embeddings.command("merge")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.argument("file", type=click.Path(dir_okay=False))
def embeddings_merge(out: str, file: str) -> None:
    """Merge OUT's shard files into FILE (Parquet), ordered by person id, in memory of about one shard."""
    from .embed.check import merge_embeddings

    n = merge_embeddings(out, file)
    click.echo(f"{file}: {n:,} persons")


if __name__ == "__main__":  # `python -m lifeseq_shards.cli ...` is `shardify ...` (it did nothing, with exit 0)
    main()
