#!/usr/bin/env bash
# Here, once, before `bash tools/device_check.sh all` on a lent GPU machine (no network there): what it carries, in
# the two ignored folders the device tool's `carry` names, and their size against the 64 MiB a call takes along.
#
#   THEIR_REPO=<a clone or the fetched mirror of odissei-lifecourse/life-sequencing-dutch> bash tools/device_prep.sh
#
#   .whl/        wheels for the machine's Python 3.12 that its image lacks (--no-deps): webdataset, braceexpand,
#                zstandard (this project's reader); performer-pytorch, local-attention, axial-positional-embedding
#                (their model; einops, pandas, h5py, torchmetrics are in the image)
#   .devshared/  lifeseq-sample (the tests' sample), bench-data and bench-data-1024 (the bench's 20,000 synthetic
#                persons at 512 and 1,024 tokens, shards only), seed (tools/seed_bench.py prepare: their commit as it
#                is and patched, 6,000 persons at 512 and 2,000 at 1,024 as their encoded_mlm.h5 and as shards)
# Each part is kept if already there. Ends with what will travel; exit 1 if it is over 64 MiB.
set -euo pipefail
PY=${PYTHON:-python3}
: "${THEIR_REPO:?set THEIR_REPO to their repository (a clone or the fetched mirror)}"
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.devshared/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >>"$EXCLUDE"; done

if [ ! -e .whl/done ]; then
  mkdir -p .whl
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    webdataset braceexpand zstandard
  # their pins, pure Python (axial-positional-embedding 0.2.1 is a source release only: built into a wheel here)
  $PY -m pip wheel -q --no-deps -w .whl performer-pytorch==1.1.4 local-attention==1.9.14 \
    axial-positional-embedding==0.2.1
  touch .whl/done
fi
mkdir -p .devshared
[ -e .devshared/lifeseq-sample ] || cp -r "${SAMPLE:-../shared/data/lifeseq-sample}" .devshared/lifeseq-sample
for PART in "bench-data 512" "bench-data-1024 1024"; do
  read -r NAME L <<<"$PART"
  [ -e ".devshared/$NAME/shards/manifest.json" ] || $PY -c "from pathlib import Path
from tools.common import synth_dataset
synth_dataset(Path('.devshared/$NAME'), 20000, 0, max_seq_len=$L)"
  rm -rf ".devshared/$NAME/raw"
done
$PY -m tools.seed_bench prepare "$THEIR_REPO" --work .devshared/seed

KIB=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | du -ck --files0-from=- | tail -1 | cut -f1)
KIB=$((KIB + $(du -sk .whl .devshared | awk '{s += $1} END {print s}')))
echo "travels: $((KIB / 1024)) MiB of 64 (the tree, .whl, .devshared)"
[ "$KIB" -le $((64 * 1024)) ]
