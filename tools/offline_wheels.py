"""A directory of wheels that installs lifeseq-shards beside a pinned environment with no network (CBS remote access).

Usage: python -m tools.offline_wheels DIR [--pins constraints-pinned.txt] [--python PYTHON]

DIR gets this package's wheel and every distribution it needs that the pins (and what the pins themselves pull in)
lack, for PYTHON's interpreter and platform (the researchers' Python 3.11 on Linux: run it with such a Python). Carry
DIR in, then, in their environment: ``pip install --no-index --find-links DIR lifeseq-shards``. The pins are never
upgraded: the wheels were resolved against them (``-c PINS``), and pip finds them installed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(python: str, pins: Path, *requirements: str) -> dict[str, str]:
    """{name: version} of everything pip would install for ``requirements`` under the constraints ``pins`` into an
    empty environment of ``python`` (a dry run: nothing is installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                        str(report), "-c", str(pins), *requirements], check=True)
        items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def build(out: Path, pins: Path, python: str) -> list[str]:
    """Fill ``out`` (emptied first); returns the distributions it holds besides this package."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    subprocess.run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)], check=True)
    wheel = next(out.glob("lifeseq_shards-*.whl"))
    theirs = resolved(python, pins, "-r", str(pins))
    ours = resolved(python, pins, str(wheel))
    missing = sorted(f"{name}=={version}" for name, version in ours.items()
                     if name not in theirs and name != "lifeseq-shards")
    clash = sorted(f"{name} {theirs[name]} -> {v}" for name, v in ours.items() if name in theirs and theirs[name] != v)
    if clash:  # -c pins makes pip keep them; a transitive one of theirs moving would be an upgrade in their env
        raise SystemExit(f"lifeseq-shards would change packages of the pinned environment: {'; '.join(clash)}")
    if missing:
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(out),
                        *missing], check=True)
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--pins", type=Path, default=REPO / "constraints-pinned.txt")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose tags the wheels must fit")
    args = ap.parse_args(argv)
    missing = build(args.out, args.pins, args.python)
    print(f"{args.out}: lifeseq-shards and {len(missing)} distributions the pins lack ({', '.join(missing)}); "
          f"install with: pip install --no-index --find-links {args.out} lifeseq-shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
