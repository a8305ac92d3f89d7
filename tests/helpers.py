"""What the test modules share: the reference rows, the person ids read straight from shard files, the CLI runner
(fixtures live in conftest.py). Expectations come from the inputs and the documented layout, not from the code
under test."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import struct
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import zstandard
from click.testing import CliRunner

from lifeseq_shards import compat
from lifeseq_shards.cli import main
from lifeseq_shards.convert.sources.parquet import encode_parquet_task, parquet_tasks
from lifeseq_shards.plan.partition import left_out_segments

# the dtype a uint16 column has as a tensor: torch.uint16, or its int16 view where torch has no uint16 (< 2.3)
U16 = compat.torch_dtype("uint16")

REPO = Path(__file__).resolve().parents[1]
# the researchers' repository (odissei-lifecourse/life-sequencing-dutch), as the search tool's fetch lays it out
THEIR_MIRROR = Path("/work/.mirror/odissei-lifecourse+life-sequencing-dutch/repo")
SMALL_SHARDS = {"min_shard_persons": 100}  # the sample's 5,845 persons in ~50 shards, not 4
FIELDS = ("tokens", "abspos", "age", "segment")  # the rows of the seed's input_ids


class SeedRows:
    """The seed's step-5 rows addressed by person id: ``input_ids`` (n, 4, width) int64, ``padding_mask``,
    ``original_sequence``, ``sequence_id`` and, from an MLM file, its target columns."""

    def __init__(self, cols: dict[str, np.ndarray]) -> None:
        self.cols = cols
        self.row = {int(p): i for i, p in enumerate(cols["sequence_id"])}
        assert len(self.row) == len(cols["sequence_id"]), "a person id occurs twice"
        self.length = cols["padding_mask"].sum(axis=1)

    @classmethod
    def from_h5(cls, path: Path) -> SeedRows:
        """The seed's own encoded file."""
        with h5py.File(path, "r") as f:
            return cls({k: f[k][()] for k in f})

    @classmethod
    def from_parquet(cls, path: Path, vocab: dict[str, int], max_seq_len: int = 512, **kw: object) -> SeedRows:
        """A step-4 parquet file through the parquet source's own encoder (int64, before the converter narrows
        anything), laid out as the seed's step 5 lays it out; ``kw`` goes to the encoder (``time_range``)."""
        pids, rows = [], []
        for task in parquet_tasks(path):
            block = encode_parquet_task(task, vocab, max_seq_len=max_seq_len, **kw)  # type: ignore[arg-type]
            assert all(col.dtype == np.int64 for col in block.columns.values())
            off = block.offsets()
            pids += block.columns["person_id"].tolist()
            rows += [np.stack([block.columns[f][off[j] : off[j + 1]] for f in FIELDS]) for j in range(len(off) - 1)]
        ids = np.zeros((len(rows), len(FIELDS), max_seq_len), dtype=np.int64)
        for i, row in enumerate(rows):
            assert row.shape[1] < max_seq_len, f"person {pids[i]}: {row.shape[1]} tokens, the cap is {max_seq_len}"
            ids[i, :, : row.shape[1]] = row
        lengths = np.array([row.shape[1] for row in rows], dtype=np.int64)
        mask = (np.arange(max_seq_len)[None, :] < lengths[:, None]).astype(np.int64)
        return cls({"sequence_id": np.array(pids, dtype=np.int64), "input_ids": ids, "padding_mask": mask,
                    "original_sequence": ids[:, 0].copy()})

    @classmethod
    def from_stored(cls, persons: dict[int, dict[str, np.ndarray]], width: int) -> SeedRows:
        """Persons read back from shards (person id -> unpadded per-field arrays) rebuilt in the seed's padded
        int64 layout, to compare with the seed's own rows."""
        rows = [_seed_row(rec, width) for rec in persons.values()]
        cols = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        return cls({"sequence_id": np.array(list(persons), dtype=np.int64), **cols})

    def rows(self, person_ids: Iterable[object]) -> np.ndarray:
        return np.array([self.row[int(p)] for p in person_ids])  # type: ignore[call-overload]

    def unpadded(self, person_id: int) -> np.ndarray:
        """One person's (4, length) tokens / abspos / age / segment."""
        row = self.row[person_id]
        return self.cols["input_ids"][row, :, : self.length[row]]


def _seed_row(rec: dict[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
    """Rebuild the seed's padded int64 rows from one stored person (what the h5 holds)."""
    n = int(rec["length"])
    row = {}
    ids = np.zeros((4, width), dtype=np.int64)
    ids[0, :n] = rec["masked_tokens"] if "masked_tokens" in rec else rec["tokens"]
    for j, name in enumerate(("abspos", "age", "segment"), start=1):
        ids[j, :n] = rec[name]
    row["input_ids"] = ids
    row["padding_mask"] = (np.arange(width) < n).astype(np.int64)
    orig = np.zeros(width, dtype=np.int64)
    orig[:n] = rec["tokens"]
    row["original_sequence"] = orig
    if "n_targets" in rec:
        slots, k = int(np.floor(0.3 * width)), int(rec["n_targets"])
        pos, tok = np.full(width, -1, dtype=np.int64), np.full(width, -1, dtype=np.int64)
        pos[:slots], tok[:slots] = width - 1, 0
        pos[:k], tok[:k] = rec["target_pos"], rec["target_tokens"]
        row["target_pos"], row["target_tokens"] = pos, tok
        row["target_cls"] = np.int64(rec["target_cls"])
    return row


def shard_ids(path: Path) -> np.ndarray:
    """Person ids of one shard, decoded by hand: tar members of zstd blocks, 'LSB1', uint32 n, then n int64 ids."""
    ids = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            fh = tar.extractfile(member)
            assert fh is not None
            raw = zstandard.ZstdDecompressor().decompress(fh.read())
            assert raw[:4] == b"LSB1"
            (n,) = struct.unpack_from("<I", raw, 4)
            ids.append(np.frombuffer(raw, dtype="<i8", count=n, offset=12))
    return np.concatenate(ids)


def split_ids(root: Path, split: str) -> tuple[list[np.ndarray], np.ndarray]:
    """(ids of each shard in manifest order, ids of the remainder shard), read from the files, not the reader."""
    info = json.loads((root / "manifest.json").read_text())["splits"][split]
    rem = info["remainder"]
    return [shard_ids(root / s["file"]) for s in info["shards"]], (
        shard_ids(root / rem["file"]) if rem else np.zeros(0, dtype=np.int64))


def trained_ids(root: Path, world: int, workers: int, epoch: int) -> tuple[set[int], set[int]]:
    """(every train person, remainder included; those of them the plan leaves out of ``epoch`` for ``world`` ranks x
    ``workers``), read from the shard files at the positions ``plan.left_out_segments`` names."""
    shards, rem = split_ids(root, "train")
    files = [*shards, rem]
    left = left_out_segments([len(s) for s in shards], world, workers, epoch=epoch, remainder=len(rem))
    return set(np.concatenate(files).tolist()), {int(i) for seg in left for i in files[seg.shard][seg.start : seg.stop]}


def shardify(*args: object) -> tuple[int, str]:
    """Run the CLI in-process: (exit code, stdout and stderr)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


TIME_SCALE = "LIFESEQ_TEST_TIME_SCALE"


def their_repo() -> Path | None:
    """Their repository (a clone or a bare mirror) for the tests that check against their own code: ``THEIR_REPO``,
    else :data:`THEIR_MIRROR`; None where it is absent (those tests skip)."""
    repo = Path(os.environ.get("THEIR_REPO", THEIR_MIRROR))
    return repo if repo.exists() else None


@contextlib.contextmanager
def their_code(dest: Path) -> Iterator[None]:
    """Their ``pop2vec`` package importable from ``dest`` (a copy of their code) for the duration: every ``pop2vec``
    module imported before is set aside, so an earlier test's copy (unpatched, say) is never the one imported here,
    and this copy's modules are dropped afterwards."""
    def theirs() -> dict[str, Any]:
        return {k: m for k, m in sys.modules.items() if k == "pop2vec" or k.startswith("pop2vec.")}

    before = theirs()
    for name in before:
        del sys.modules[name]
    sys.path.insert(0, str(dest))
    try:
        yield
    finally:
        sys.path.remove(str(dest))
        for name in theirs():
            del sys.modules[name]
        sys.modules.update(before)


def scaled(seconds: float) -> float:
    """``seconds`` times the environment's LIFESEQ_TEST_TIME_SCALE (a positive float, default 1). Every deadline of the
    tests goes through it, so one variable stretches them all on a loaded machine (.ci/run sets it): pytest-timeout's
    limits (conftest.py), the multi-process launches (ddp_harness.launch), :func:`wait_for` and each subprocess's
    ``timeout``. Deadlines are written as the seconds they take on the 2-core machine alone."""
    raw = os.environ.get(TIME_SCALE, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{TIME_SCALE}={raw!r}: give a positive number (1 on the machine alone, e.g. 3 under load)")
    return seconds * scale


def wait_for(cond: Callable[[], bool], seconds: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``seconds`` (scaled) pass (False): a process's effect, with a hard
    bound."""
    end = time.monotonic() + scaled(seconds)
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def repo_first(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on PYTHONPATH: a child process imports the code under test, whatever is
    installed."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def to_format2(m: dict[str, Any]) -> None:
    """A manifest as the converter wrote it before format 3: no head_checksum nor block_checksums (nor schema tags in
    the blocks, unchecked then)."""
    m["format_version"] = 2
    for info in m["splits"].values():
        for e in [*info["shards"], info["remainder"] or {}]:
            e.pop("head_checksum", None)
            e.pop("block_checksums", None)


@contextlib.contextmanager
def serve_directory(root: Path) -> Iterator[str]:
    """A real HTTP server on loopback serving ``root`` (quietly), as its base URL with a trailing slash."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def group_pids(pgid: int) -> set[int]:
    """Live (not zombie) processes of a process group."""
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = (Path("/proc") / d / "stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            out.add(int(d))
    return out


def shm_files(pids: set[int]) -> set[Path]:
    """The /dev/shm files the processes have mapped (semaphores, shared memory), unlinked ones left out."""
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in (Path("/proc") / str(pid) / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/") and not path[0].endswith("(deleted)"):
                    out.add(Path(path[0]))
    return out


# -- a dataset edited as a hostile user would ------------------------------------------------------------------------
ManifestJSON = dict[str, Any]


def copy_of(root: Path, tmp_path: Path) -> Path:
    shutil.copytree(root, tmp_path / "ds")
    return tmp_path / "ds"


def edit_manifest(root: Path, change: Callable[[ManifestJSON], object], refit: bool = False) -> None:
    """Edit the manifest; with ``refit``, recompute its fingerprint too (an edit that hides itself)."""
    from lifeseq_shards.store.manifest import Manifest, fingerprint

    m = json.loads((root / "manifest.json").read_text())
    change(m)
    if refit:
        typed = Manifest.from_json(m)
        m["fingerprint"] = fingerprint(typed.schema, [e.sha256 for _, e in typed.entries()])
    (root / "manifest.json").write_text(json.dumps(m))


def swap_fields(a: str, b: str) -> Callable[[ManifestJSON], None]:
    """A manifest edit: fields ``a`` and ``b`` swap names in the schema."""
    def change(m: ManifestJSON) -> None:
        for f in m["schema"]:
            f["name"] = {a: b, b: a}.get(f["name"], f["name"])
    return change


def read_all(root: Path | str, split: str = "train") -> list[dict[str, Any]]:
    """One reader's whole epoch of ``split`` in batches of 100."""
    from lifeseq_shards.reader import ShardedDataset, World

    return list(ShardedDataset(root, split=split, batch_size=100, world=World(0, 1)))


def assert_one_line_exit_2(args: list[str], needle: str) -> None:
    """`shardify ARGS` exits 2 with one line of output, an error holding ``needle``."""
    code, out = shardify(*args)
    assert code == 2, out
    assert out.count("\n") == 1 and out.startswith("error: ") and needle in out, out


def both_layouts(data: Path, persons: int = 12) -> tuple[Any, Any, int]:
    """The first ``persons`` train persons of ``data`` (offline MLM masks) as the padded model batch (512 positions,
    as their loader gives it) and as the packed one, and a vocabulary size that holds their tokens: the same persons
    and targets for their model padded and packed."""
    import torch

    from lifeseq_shards.device.build import count_tokens, model_batch
    from lifeseq_shards.reader import ShardedDataset

    host = next(iter(ShardedDataset(data, split="train", batch_size=persons, seed=0, packed=True)))
    counted = count_tokens(host.with_buffer(torch.from_numpy(host.buffer)))
    padded, flat = model_batch(counted, layout="padded", max_len=512), model_batch(counted, layout="packed")
    assert int((padded["target_tokens"] != 0).sum()) > persons and int(padded["lengths"].max()) < 512
    return padded, flat, int(max(padded["input_ids"][:, 0].max(), padded["target_tokens"].max())) + 1


def rezero_gains(encoder: Any, value: float = 0.5) -> None:
    """Their encoder's ReZero gains (their init: 0, which leaves out attention) set to ``value``, so that every
    term counts in a comparison."""
    import torch

    with torch.no_grad():
        for name, p in encoder.named_parameters():
            if name.endswith(".weights"):
                p.fill_(value)
