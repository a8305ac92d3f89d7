"""`make wheels`, then `pip install --no-index --find-links DIR lifeseq-shards` into an environment that holds the
researchers' pins (constraints-pinned.txt) and nothing of this package's: it installs with no index, moves none of
the pins, and the installed package converts and reads a dataset."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PINNED = REPO / ".venv-pinned"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins_only_view(site: Path, leave_out: set[str], view: Path) -> None:
    """``view``: symlinks to every distribution of ``site`` but those named in ``leave_out`` (their top-level files
    and metadata), so that an environment with ``view`` on its path has the pins without a second 2.5 GB install."""
    view.mkdir()
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if canonical(dist.metadata["Name"]) in leave_out:
            continue
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            if (site / top).exists() and not (view / top).exists():
                (view / top).symlink_to(site / top)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheels_install_offline_beside_the_pins(tmp_path: Path) -> None:
    # It runs the pinned stack's interpreter whichever suite holds it; the newest stack's suite does (make test runs
    # both side by side, and the pinned one, slower, ends minutes later: this test's 2 minutes go to the other).
    pinned = PINNED / "bin" / "python"
    if Path(sys.prefix).resolve() == PINNED.resolve() or not pinned.exists():
        pytest.skip("runs in the newest stack's suite beside .venv-pinned (make test runs it): it installs beside the "
                    "pins of that environment")
    wheels = tmp_path / "wheels"
    subprocess.run(["make", "wheels", f"WHEELS={wheels}", f"PINNED_PYTHON={pinned}"], cwd=REPO, check=True)
    carried = {canonical(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    assert "lifeseq-shards" in carried and not carried & {"torch", "numpy", "lightning", "pytorch-lightning", "h5py"}
    site = Path(subprocess.run([pinned, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    pins_only_view(site, carried, tmp_path / "pins")

    env_dir = tmp_path / "theirs"
    subprocess.run([pinned, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    own_site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    (own_site / "their-pins.pth").write_text(f"{tmp_path / 'pins'}\n")
    offline = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    before = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(site)])}
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "lifeseq-shards"],
                   check=True, env=offline, cwd=tmp_path)

    installed = {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions(path=[str(own_site)])}
    assert installed - {"pip", "setuptools"} == carried, "pip installed other than what the directory carries"
    probe = ("import json, numpy, torch, lightning, pytorch_lightning, h5py, lifeseq_shards; print(json.dumps({"
             "'numpy': numpy.__version__, 'torch': torch.__version__.split('+')[0], 'lightning': lightning.__version__,"
             " 'pytorch-lightning': pytorch_lightning.__version__, 'h5py': h5py.__version__,"
             " 'at': lifeseq_shards.__file__}))")
    seen = json.loads(subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True,
                                     cwd=tmp_path).stdout)
    for name in ("numpy", "torch", "lightning", "pytorch-lightning", "h5py"):
        assert seen[name] == before[name].split("+")[0], f"{name} moved: {before[name]} -> {seen[name]}"
    assert Path(seen["at"]).is_relative_to(own_site), seen["at"]

    shardify = env_dir / "bin" / "shardify"
    subprocess.run([shardify, "synth", "raw", "--people", "200", "--seed", "0"], check=True, cwd=tmp_path)
    subprocess.run([shardify, "convert", "raw/sequences.parquet", "--vocab", "raw/vocab.csv", "-o", "shards"],
                   check=True, cwd=tmp_path)
    read = ("from lifeseq_shards import ShardedDataset, ShardedLoader\n"
            "from lifeseq_shards.reader import World\n"
            "from lifeseq_shards.store.remote import read_manifest\n"
            "ds = ShardedDataset('shards', split='train', batch_size=16, world=World(0, 1), mode='complete')\n"
            "n = sum(len(b['person_id']) for b in ShardedLoader(ds))\n"
            "print(n, read_manifest('shards').splits['train'].persons)")
    got, want = map(int, subprocess.run([py, "-c", read], check=True, capture_output=True, text=True,
                                         cwd=tmp_path).stdout.split())
    assert got == want > 0
