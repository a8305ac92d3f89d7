"""How `make test`'s pytest-xdist processes share the suite (a plugin tests/conftest.py loads). Under
``--dist loadfile`` each test file goes whole to one process, so that its module fixtures run once; the files in
SHARED_FILES, whose tests read a session fixture that launches a multi-rank run (LAUNCHED_ONCE), go together to one
process, so that the run is launched once. Collection refuses a test that reads one from a file not listed.

xdist's own groups (``--dist loadgroup`` with ``xdist_group`` marks) do not group on pytest 9.2, whose node ids
xdist 3.8 can no longer suffix (pytest-dev/pytest-xdist#1386): a scheduler of our own does it instead."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

# The session fixtures that launch a multi-rank run whose result tests in several files read (tests/conftest.py,
# tests/reader/conftest.py), and the files with such tests, as node ids name them (from the repository's root).
LAUNCHED_ONCE = frozenset({"torchrun_two", "lightning_spawn", "lightning_spawn_resumed"})
SHARED_FILES = frozenset({"tests/reader/test_ddp.py", "tests/reader/test_ddp_elastic.py", "tests/test_compat.py"})
SHARED_GROUP = "launched-once"


class SharedLaunchScheduling(LoadFileScheduling):
    """xdist's ``loadfile``, with the SHARED_FILES as one file."""

    def _split_scope(self, nodeid: str) -> str:
        file = super()._split_scope(nodeid)
        return SHARED_GROUP if file in SHARED_FILES else file


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadFileScheduling | None:
    return SharedLaunchScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        launched = LAUNCHED_ONCE.intersection(getattr(item, "fixturenames", ()))
        if launched and file not in SHARED_FILES:
            raise pytest.UsageError(f"{file} reads {', '.join(sorted(launched))}: add it to tests/xdist_groups.py's "
                                    f"SHARED_FILES, so that make test's xdist processes launch it once")
