"""Progress bars: tqdm's bar on a terminal, plain lines into a file (a SLURM log), where a bar redrawn with ``\\r``
became one endless line."""

from __future__ import annotations

import io
from pathlib import Path

from helpers import shardify

from lifeseq_shards.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_plain_lines_a_terminal_the_bar() -> None:
    log, term = io.StringIO(), Terminal()
    for stream in (log, term):
        for _ in progress_bar(range(3), file=stream, desc="encode", mininterval=0):
            pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert lines[0].startswith("encode:") and "0/3" in lines[0] and "3/3" in lines[-1], lines
    assert "\r" in term.getvalue()


def test_shardify_writes_no_carriage_return_into_a_log(tmp_path: Path) -> None:
    """A command's output that is not a terminal (CliRunner's, as a SLURM log) holds whole lines only."""
    code, out = shardify("synth", tmp_path / "raw", "--people", 50)
    assert code == 0 and "\r" not in out and any(line.startswith("synth:") for line in out.splitlines()), out
