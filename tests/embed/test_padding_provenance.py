"""Embedding files record how the model saw each person (issue 39): padded, packed as if padded to N
(``PackedPerformer(pad_to=N)``) or packed unpadded, and the padded length it emulates, in ``_embeddings.json`` and in
every file's stamp. The researchers' performer embeds a person differently in each, so `shardify embeddings verify`
and `merge` refuse, in one line and exit 2, a directory that mixes them, and so does a job resuming into it; files
written before the padding was recorded read as plain "padded"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from embed_helpers import embed_in_process, model_for, verify
from helpers import shardify

from lifeseq_shards import EmbeddingWriter
from lifeseq_shards.embed.spec import Padding
from lifeseq_shards.embed.stamp import STAMP_KEY
from lifeseq_shards.embed.store import EmbeddingsError
from lifeseq_shards.reader import World

VICTIM = "train/shard-000002.parquet"
PACKED = "packed pad_to=512"


@pytest.fixture(scope="module")
def packed(ds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "emb"
    embed_in_process(ds, out, padding=PACKED)
    return out


@pytest.fixture(scope="module")
def unpadded(ds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unpadded") / "emb"
    embed_in_process(ds, out, padding="packed unpadded")
    return out


def stamp(path: Path) -> dict:
    return json.loads(pq.read_metadata(path).metadata[STAMP_KEY])


def manifest(out: Path) -> dict:
    return json.loads((out / "_embeddings.json").read_text())


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def resume(out: Path, ds: Path, padding: str) -> list[str]:
    return EmbeddingWriter(out, padding=padding).open(ds, model=model_for(ds), world=World(0, 1))


def test_the_manifest_and_every_file_record_the_padding(ds: Path, packed: Path) -> None:
    assert manifest(packed)["padding"] == PACKED
    files = sorted(packed.rglob("*.parquet"))
    assert len(files) == 11 and {stamp(f)["padding"] for f in files} == {PACKED}
    assert verify(packed, ds)[0] == 0


def test_a_file_of_another_padding_is_refused_by_verify_merge_and_a_resuming_job(ds: Path, packed: Path,
                                                                                 unpadded: Path, tmp_path: Path
                                                                                 ) -> None:
    """The same model and shard embedded packed unpadded, copied into a directory of packed pad_to=512: one line
    naming the file and both modes, exit 2, nothing merged; a job resuming into it is refused too."""
    out = tmp_path / "emb"
    shutil.copytree(packed, out)
    shutil.copy(unpadded / VICTIM, out / VICTIM)
    assert stamp(out / VICTIM)["model"] == stamp(packed / VICTIM)["model"]  # only the padding tells them apart
    for cmd in (("verify", out, "--data", ds), ("merge", out, tmp_path / "merged.parquet")):
        code, text = shardify("embeddings", *cmd)
        lines = error_lines(text)
        assert code == 2 and len(lines) == 1, (cmd, text)
        assert VICTIM in lines[0] and "'packed unpadded' (its stamp)" in lines[0] and f"'{PACKED}'" in lines[0]
    assert not list(tmp_path.glob("merged*"))
    with pytest.raises(EmbeddingsError, match=f"{VICTIM}: embedded with padding 'packed unpadded'"):
        resume(out, ds, PACKED)
    with pytest.raises(EmbeddingsError, match=f"holds other embeddings \\(padding '{PACKED}', not 'padded'\\)"):
        resume(packed, ds, "padded")


def strip_padding(out: Path) -> None:
    """As written before the padding was recorded: no "padding" in the manifest or in any stamp."""
    m = manifest(out)
    del m["padding"]
    (out / "_embeddings.json").write_text(json.dumps(m))
    for path in out.rglob("*.parquet"):
        table = pq.read_table(path)
        old = {k: v for k, v in stamp(path).items() if k != "padding"}
        pq.write_table(table.replace_schema_metadata({STAMP_KEY: json.dumps(old).encode()}), path)


def test_files_written_before_the_padding_was_recorded_read_as_padded(ds: Path, done: Path, unpadded: Path,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "emb"
    shutil.copytree(done, out)
    strip_padding(out)
    assert verify(out, ds)[0] == 0
    code, text = shardify("embeddings", "merge", out, tmp_path / "merged.parquet")
    assert code == 0, text
    assert len(resume(out, ds, "padded")) == 11  # the default: nothing to embed again
    shutil.copy(unpadded / VICTIM, out / VICTIM)
    code, text = verify(out, ds)
    assert code == 2 and "'packed unpadded' (its stamp), but _embeddings.json says 'padded'" in text, text


@pytest.mark.parametrize("text", ["packed", "padded unpadded", "packed pad_to=0", "pad_to=512"])
def test_a_padding_that_says_nothing_clear_is_refused(text: str, tmp_path: Path) -> None:
    with pytest.raises(EmbeddingsError, match="one of 'padded pad_to=N', 'packed pad_to=N', 'packed unpadded'"):
        EmbeddingWriter(tmp_path, padding=text)


def test_the_padding_reads_back_as_written() -> None:
    for text in ("padded", "padded pad_to=1024", PACKED, "packed unpadded"):
        assert str(Padding.parse(text)) == text
