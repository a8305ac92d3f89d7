"""``verify`` (re-hash and decode everything, compare with the manifest), ``upgrade`` (verify, then add the blocks'
checksums and the lengths indexes that older datasets lack) and ``inspect`` (a readable summary)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
from collections.abc import Iterator, Sequence
from math import prod
from pathlib import Path

import numpy as np

from ..progress import progress_bar
from ..store.format import CHECKSUMMED_VERSION, RAGGED, RUN_LENGTH, RUNS, TAGGED_VERSION, Block, Field, decode_member
from ..store.lengths import index_lengths, write_lengths_index
from ..store.manifest import MANIFEST, LengthsIndex, Manifest, ManifestError, ShardEntry, write_manifest
from ..store.remote import is_local, read_manifest
from ..store.shardfile import ShardFile, frame_checksum, iter_tar_members, sha256_file
from ..store.writes import writing
from .outdir import LOCK
from .sources import drops

KIND_MARK = {RAGGED: "[L]", RUNS: "[runs]"}  # per token; once per run of tokens sharing the value
__all__ = ["summarize", "upgrade_dataset", "verify_dataset"]


def verify_dataset(root: str | Path, progress: bool = True) -> list[str]:
    """Every problem found, one line each naming the shard (and block / person); empty when all holds. The blocks
    are checked the way the reader checks them (:class:`ShardFile`) and more, so that OK means the dataset trains:
    a dataset without the blocks' checksums, which the reader refuses, is a problem too."""
    problems, manifest, _, _ = _verify(root, progress, "verify")
    if any(e.block_checksums is None for _, e in manifest.entries()):
        problems.append(f"manifest: format {manifest.format_version}, without per-block checksums: the reader refuses "
                        f"it; `shardify upgrade {root}` adds them")
    return problems


def upgrade_dataset(root: str | Path, progress: bool = True) -> tuple[Manifest, list[str]]:
    """Verify the dataset at the local directory ``root``, then write its manifest again with every block's checksum
    (a format-3 dataset becomes the format 4 the converter writes now; formats 1 and 2 keep their version, which says
    how their blocks are laid out) and a lengths index for each split without one (written before the manifest,
    from the lengths verify decoded; an index verify found sound is kept as it is, so a second upgrade changes
    nothing). The shards and the fingerprint stay as they are. The checksums are read from shards whose sha256 the
    manifest vouches for, so a block swapped since the conversion is found, not blessed. ``progress``: a progress
    bar. Returns the manifest and the problems: with any, nothing is written."""
    root = _local(root, "upgrade")
    if _up_to_date(read_manifest(root)):  # nothing to write: a read-only copy is verified as it is, with no lock
        problems, manifest, _, _ = _verify(root, progress, "upgrade")
        return manifest, problems
    with _conversion_lock(root):
        problems, manifest, checksums, lengths = _verify(root, progress, "upgrade")
        if problems:
            return manifest, problems

        def add(e: ShardEntry) -> ShardEntry:
            return dataclasses.replace(e, block_checksums=checksums[e.file])

        version = CHECKSUMMED_VERSION if manifest.format_version == TAGGED_VERSION else manifest.format_version
        with writing(root / MANIFEST, "the manifest is unchanged (not upgraded)"):
            splits = {name: dataclasses.replace(
                s, shards=tuple(map(add, s.shards)), remainder=s.remainder and add(s.remainder),
                lengths=s.lengths or write_lengths_index(root, name, lengths[name], manifest.schema))
                for name, s in manifest.splits.items()}
            new = dataclasses.replace(manifest, format_version=version, splits=splits)
            write_manifest(root, new)
        return new, []


@contextlib.contextmanager
def _conversion_lock(root: Path) -> Iterator[None]:
    """The lock a conversion holds (outdir.py): no upgrade while a conversion replaces the dataset, nor after. A
    directory upgrade may not write to (a shared read-only copy) is refused here, naming the cause."""
    with writing(root, "not upgraded: it lacks block checksums or lengths indexes, which upgrade writes into it"):
        fh = open(root / LOCK, "a")
    with fh:  # closing it releases the lock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ManifestError(f"{root}: a conversion is writing to it ({LOCK} is locked)") from None
        yield


def _up_to_date(m: Manifest) -> bool:
    """Whether upgrade would write the manifest as it is: every block's checksum and every split's lengths index."""
    return (m.format_version != TAGGED_VERSION and all(e.block_checksums is not None for _, e in m.entries())
            and all(s.lengths for s in m.splits.values()))


def _local(root: str | Path, command: str) -> Path:
    """A remote root is refused: ``Path`` turned ``http://host/ds`` into ``http:/host/ds``, reported as 'no
    manifest'."""
    if not is_local(str(root)):
        raise ManifestError(f"{root}: {command} re-hashes the shards on the local disk; copy the dataset here, or "
                            f"run {command} on the machine that holds it")
    return Path(root)


def _verify(root: str | Path, progress: bool, command: str) -> tuple[list[str], Manifest, dict[str, tuple[int, ...]],
                                                                      dict[str, np.ndarray]]:
    """verify's problems, the manifest, each shard file's block checksums as read, and each split's lengths as
    decoded (in the split's order)."""
    root = _local(root, command)
    manifest = read_manifest(root)
    problems: list[str] = []
    entries = list(manifest.entries())
    seen: dict[str, set[int]] = {}
    tokens_by_split: dict[str, int] = {}
    checksums: dict[str, tuple[int, ...]] = {}
    decoded: dict[str, list[np.ndarray]] = {name: [] for name in manifest.splits}
    indexes = {name: _IndexCheck(root, s.lengths, sum(e.samples for e in s.entries()), problems)
               for name, s in manifest.splits.items() if s.lengths}
    for split, e in progress_bar(entries, desc=command, unit="shard", disable=not progress):
        path = root / e.file
        index = indexes.get(split)
        if not path.is_file():
            problems.append(f"{e.file}: missing" + (" (a directory)" if path.exists() else ""))
            if index:
                index.skip(e)
            continue
        if path.stat().st_size != e.bytes:
            problems.append(f"{e.file}: {path.stat().st_size} bytes, manifest says {e.bytes}")
        if sha256_file(path) != e.sha256:
            problems.append(f"{e.file}: sha256 differs from the manifest")
        shard = manifest.shard_file(e, e.file)
        if shard.block_checksums is not None and len(shard.block_checksums) != shard.blocks:
            problems.append(f"{e.file}: the manifest lists {len(shard.block_checksums)} block checksums, its "
                            f"{e.samples} persons in blocks of {manifest.block_persons} make {shard.blocks} blocks")
        checksums[e.file], lengths, ids = _check_records(path, shard, manifest.schema, manifest.vocab_size, problems,
                                                         seen.setdefault(split, set()))
        persons, tokens = len(lengths), int(lengths.sum(dtype=np.int64))
        decoded[split].append(lengths)
        if index:
            index.compare(e, lengths, ids)
        tokens_by_split[split] = tokens_by_split.get(split, 0) + tokens
        if persons != e.samples:
            problems.append(f"{e.file}: {persons} persons decoded, manifest says {e.samples}")
        if tokens != e.tokens:
            problems.append(f"{e.file}: {tokens} tokens decoded, manifest says {e.tokens}")
    for split, info in manifest.splits.items():
        n = sum(x.samples for x in info.entries())
        if n != info.persons:
            problems.append(f"manifest: split {split} lists {n} persons in its shards, says {info.persons}")
        if any(x.samples != info.shard_persons for x in info.shards):
            problems.append(f"manifest: split {split} has shards that do not hold {info.shard_persons} persons")
    if "train" in seen and "val" in seen and seen["train"] & seen["val"]:
        problems.append(f"train and val share {len(seen['train'] & seen['val'])} persons")
    base = [s for s in ("train", "val") if s in seen]
    if sum(len(seen[s]) for s in base) != manifest.totals.persons:
        problems.append(f"manifest: totals.persons {manifest.totals.persons} != "
                        f"{sum(len(seen[s]) for s in base)} persons decoded in train + val")
    if sum(tokens_by_split.get(s, 0) for s in base) != manifest.totals.tokens:
        problems.append("manifest: totals.tokens differs from the tokens decoded in train + val")
    if not manifest.fingerprint_matches:
        problems.append("manifest: fingerprint does not match its schema and shard checksums")
    return problems, manifest, checksums, {name: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
                                           for name, parts in decoded.items()}


class _IndexCheck:
    """A split's lengths index held against the lengths its blocks decode to, shard by shard in the split's order:
    its first wrong person is one problem line naming the index file (one line: the rest of the split follows)."""

    def __init__(self, root: Path, index: LengthsIndex, persons: int, problems: list[str]) -> None:
        """``persons``: what the split's shards hold, by the manifest's counts."""
        self.index, self.problems = index, problems
        self.at = 0  # the split's first person of the next shard, by the manifest's counts
        self.values: np.ndarray | None = None
        path = root / index.file
        if not path.is_file():
            problems.append(f"{index.file}: missing (the lengths index the manifest lists)")
            return
        try:
            self.values = index_lengths(path.read_bytes(), index, persons)
        except ValueError as e:
            problems.append(f"{index.file}: {e}")

    def skip(self, entry: ShardEntry) -> None:
        """A shard that could not be read: its persons are not compared."""
        self.at += entry.samples

    def compare(self, entry: ShardEntry, lengths: np.ndarray, ids: np.ndarray) -> None:
        """``entry``'s persons as decoded (their lengths and ids, in shard order) against the index."""
        if self.values is not None:
            want = self.values[self.at : self.at + entry.samples]
            n = min(len(want), len(lengths))  # a shard decoded short is a problem of its own
            bad = np.flatnonzero(want[:n] != lengths[:n])
            if len(bad):
                j = int(bad[0])
                self.problems.append(f"{self.index.file}: person {self.at + j} of the split (id {int(ids[j])}, "
                                     f"{entry.file} record {j}) has length {int(want[j])} in the index, "
                                     f"{int(lengths[j])} in its block")
                self.values = None
        self.at += entry.samples


def _check_records(path: Path, shard: ShardFile, schema: Sequence[Field], vocab_size: int | None, problems: list[str],
                   seen: set[int]) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """A shard's every block decoded and checked (problems appended): its block checksums as read, and the lengths
    and person ids of the persons decoded, in order (copies, not views of the decompressed blocks)."""
    lengths: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    checksums: list[int] = []
    name = shard.url
    try:
        with open(path, "rb") as fh:
            for i, (member, data) in enumerate(iter_tar_members(io.BufferedReader(fh))):
                where = f"{name}: {member}"
                checksums.append(frame_checksum(data))
                try:
                    shard.check_member(i, member, data)
                except ValueError as e:
                    problems.append(f"{where}: {e}")
                try:
                    block = decode_member(data, schema, shard.tag)
                except Exception as e:  # noqa: BLE001 - any decode failure is a finding, not a crash
                    problems.append(f"{where}: cannot decode ({e})")
                    continue
                try:
                    shard.check_block(i, block)
                except ValueError as e:
                    problems.append(f"{where}: {e}")
                lengths.append(block.columns["length"].copy())
                ids.append(block.columns["person_id"].copy())
                problems.extend(f"{where}: {p}" for p in _record_problems(block, vocab_size, seen))
    except Exception as e:  # noqa: BLE001 - a truncated tar is a finding
        problems.append(f"{name}: unreadable tar ({e})")
    return (tuple(checksums), np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64),
            np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))


def _record_problems(block: Block, vocab_size: int | None, seen: set[int]) -> list[str]:
    out = []
    c = block.columns
    for i, pid in enumerate(c["person_id"].tolist()):
        if pid in seen:
            out.append(f"person {pid} (record {i}) appears twice")
        seen.add(pid)
    bad = np.nonzero(c["length"] == 0)[0]
    if len(bad):
        out.append(f"person {int(c['person_id'][bad[0]])} (record {int(bad[0])}) has no tokens")
    if vocab_size is not None and len(c["tokens"]) and int(c["tokens"].max()) >= vocab_size:
        out.append(f"token id {int(c['tokens'].max())} outside the vocabulary of {vocab_size}")
    if "n_targets" in c:
        bad = np.nonzero(c["n_targets"] > c["length"])[0]
        if len(bad):
            out.append(f"person {int(c['person_id'][bad[0]])} (record {int(bad[0])}) has more targets than tokens")
        owner = np.repeat(np.arange(block.n), c["n_targets"].astype(np.int64))
        bad = np.nonzero(c["target_pos"] >= c["length"][owner])[0]
        if len(bad):
            out.append(f"person {int(c['person_id'][owner[bad[0]]])} has a target position past its length")
    if RUN_LENGTH in c:  # a person's runs cover exactly its tokens, none of them empty
        ends = np.zeros(len(c[RUN_LENGTH]) + 1, dtype=np.int64)
        np.cumsum(c[RUN_LENGTH], out=ends[1:])
        runs = block.offsets("n_runs")
        bad = np.nonzero(ends[runs[1:]] - ends[runs[:-1]] != c["length"])[0]
        if len(bad):
            out.append(f"person {int(c['person_id'][bad[0]])} (record {int(bad[0])}) has runs that do not add up to "
                       "its length")
        if len(c[RUN_LENGTH]) and int(c[RUN_LENGTH].min()) == 0:
            out.append("a run of 0 tokens")
    return out


def length_percentile(hist: np.ndarray, width: int, q: float) -> int:
    """The upper edge of the histogram bin that holds quantile ``q`` of the persons' lengths."""
    cum = np.cumsum(hist) / max(1, hist.sum())
    return int((np.searchsorted(cum, q) + 1) * width)


def plot_lengths(root: str | Path, path: str | Path) -> None:
    """``shardify inspect --plot``: the persons' lengths (the manifest's histogram) as a picture in ``path`` (its
    suffix names the format, e.g. .png or .pdf), with the percentiles `inspect` prints marked."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window: on a cluster node there is no display
    import matplotlib.pyplot as plt

    m = read_manifest(root)
    hist = np.array(m.length_histogram.counts)
    width = m.length_histogram.bin_width
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(np.arange(len(hist)) * width, hist, width=width, align="edge")
    for q in (0.5, 0.9, 0.99):
        edge = length_percentile(hist, width, q)
        ax.axvline(edge, color="black", linestyle=":", linewidth=1)
        ax.annotate(f"p{round(q * 100)} <= {edge}", (edge, 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8)
    ax.set_xlabel(f"tokens per person (bins of {width})")
    ax.set_ylabel("persons")
    ax.set_title(f"{m.totals.persons:,} persons of {root}")
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


def _index_summary(m: Manifest) -> str:
    """inspect's line on the lengths indexes: which splits have one, and where."""
    listed = [f"{name} {s.lengths.file} ({s.lengths.dtype})" for name, s in m.splits.items() if s.lengths]
    missing = [name for name, s in m.splits.items() if not s.lengths]
    out = "lengths of " + ", ".join(listed) if listed else "no lengths index"
    if missing:
        out += (f"{'; none for ' + ', '.join(missing) if listed else ''} (the token-budget plan decodes every block "
                "for them; `shardify upgrade DIR` adds one)")
    return out


def summarize(root: str | Path) -> str:
    """What `shardify inspect` prints."""
    m = read_manifest(root)
    t = m.totals
    hist = np.array(m.length_histogram.counts)
    width = m.length_histogram.bin_width

    def pct(q: float) -> int:
        return length_percentile(hist, width, q)

    lines = [
        f"dataset      {Path(root) if is_local(str(root)) else root}",  # Path() would turn http:// into http:/
        f"fingerprint  {m.fingerprint}",
        f"persons      {t.persons:,} converted (input rows {'?' if t.input_rows is None else f'{t.input_rows:,}'})",
        f"dropped      {drops.summary(t.dropped, t.input_rows).removeprefix('dropped ')}"
        + "".join(f"; {name} {n:,}" for name, n in (t.dropped or {}).items()),
        f"tokens       {t.tokens:,} (mean {t.tokens / max(1, t.persons):.1f} per person)",
        f"bytes        {t.bytes:,} in {t.shards} files ({t.bytes / max(1, t.persons):.1f} per person)",
        f"lengths      p50 <= {pct(0.5)}, p90 <= {pct(0.9)}, p99 <= {pct(0.99)}, max bin <= {len(hist) * width}",
        "index        " + _index_summary(m),
        "fields       " + ", ".join(f"{f.name}:{f.dtype}{KIND_MARK.get(f.kind, '')}" for f in m.schema),
    ]
    params = m.params or {}
    readers = [params.get(k) for k in ("nodes", "gpus", "workers")]
    for split, info in m.splits.items():
        lines.append(f"split {split:6s} {info.persons:,} persons = {len(info.shards)} shards x "
                     f"{info.shard_persons:,} + remainder {info.remainder_persons:,} (read like the others)")
    # training leaves out persons mod readers; the conversion's arrangement, when it named one, says how many
    n = prod(r or 1 for r in readers)
    at = (f": {m.splits['train'].persons % n:,} at the {n} readers converted for (--nodes x --gpus x "
          "--workers)" if any(r is not None for r in readers) and "train" in m.splits else "")
    lines.append(f"left out     of each training epoch: train persons mod (ranks x workers), others each epoch{at}; "
                 "`shardify plan` names them")
    lines.append(f"converted    from {params.get('input_kind')} {', '.join(params.get('inputs', []))}"
                 f" (seed {params.get('seed')}, {params.get('seconds')} s)")
    return "\n".join(lines)
