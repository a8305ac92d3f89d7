"""The public surface: each package's ``__all__`` as its users need it (the tests, tools/, the docs and the
researchers' patches), every public name documented, nothing of the project's re-exported beside it."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

SURFACE = {
    "lifeseq_shards": {"DatasetChanged", "DeviceMetrics", "EmbeddingWriter", "LifeSeqData", "LifeSeqDataModule",
                       "ShardedDataset", "ShardedLoader"},
    "lifeseq_shards.reader": {"BatchSpec", "DatasetChanged", "LaunchError", "ShardedDataset", "ShardedLoader",
                              "World", "collate", "read_segment"},
    "lifeseq_shards.convert.sources": {"Source", "SourceError", "input_kind", "open_sources"},
    "lifeseq_shards.pl": {"EmbeddingWriter", "LifeSeqDataModule", "LifeSeqPretrainModule", "StopOnSigterm"},
}


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_all_is_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == module.__all__, "__all__ is kept sorted"
    assert set(module.__all__) == SURFACE[package]


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_every_public_name_says_what_it_is_for(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        obj = getattr(module, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), f"{package}.{name} is a {type(obj).__name__}"
        doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__  # a class's own, not inherited
        assert doc and doc.strip(), f"{package}.{name} has no docstring"
        assert not doc.startswith(f"{name}("), f"{package}.{name}'s docstring is the dataclass signature"
        assert len(doc.split()) >= 8, f"{package}.{name}'s docstring does not say what it is for: {doc!r}"


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_nothing_of_the_project_is_public_beside_all(package: str) -> None:
    """A class or function of lifeseq_shards reachable as a public attribute of the package is in ``__all__``: the
    others are imported from the module that defines them (submodules themselves are attributes, and fine)."""
    module = importlib.import_module(package)
    if package == "lifeseq_shards":
        for name in module.__all__:
            getattr(module, name)  # the lazy names, loaded
    extra = sorted(name for name, value in vars(module).items()
                   if not name.startswith("_") and not isinstance(value, types.ModuleType)
                   and str(getattr(value, "__module__", "")).startswith("lifeseq_shards")
                   and name not in module.__all__)
    assert extra == []


def test_reader_internals_are_reached_through_their_modules() -> None:
    """The names that left the reader's ``__all__`` are its modules' (e.g. the rings, the stages, the plan's modes)."""
    from lifeseq_shards import reader

    for name in ("BALANCED", "Segment", "EpochControl", "RingWriter", "PIPE_BYTES", "slot_windows", "collate_packed"):
        assert not hasattr(reader, name), name
    from lifeseq_shards.reader.collate import collate_packed
    from lifeseq_shards.reader.stages import slot_windows
    from lifeseq_shards.reader.transport import RingWriter

    assert all(callable(x) for x in (collate_packed, slot_windows, RingWriter))
