#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a lent GPU machine that has no network (issue 13: the padded
# vs padding-free step). Most important first, every result written as soon as it is measured, so a time limit
# still returns data. About 5-6 minutes on one H200. Into $OUT (8 files at most come back):
#   log.txt      everything below, as it ran (PYTHONUNBUFFERED)
#   env.txt      nvidia-smi, CPUs, torch/CUDA/Lightning versions, which varlen attention this torch has
#   tests.log    `pytest -m cuda`: the CUDA cases (flash varlen = padded model, prefetch, masking CPU = CUDA, ...)
#   results.csv, results.md   tools/train_bench.py --preset varlen (padded vs varlen, prefetch, compiled, seed sizes)
#   attn.csv, prep.csv        tools/bench_kernels.py (attention per head layout; batch prep, masker eager/compiled)
#   tables.md    tools/varlen_tables.py: the docs/tuning.md tables from the two above, ready to paste
#
#   Here, once: wheels of what that machine lacks into .whl/ (webdataset, braceexpand, zstandard for its Python),
#   the sample into .devshared/lifeseq-sample and the bench's 20,000 synthetic persons into .devshared/bench-data
#   (`python -c 'import sys; sys.path.insert(0, "tools"); from pathlib import Path; from train_bench import
#   synth_dataset; synth_dataset(Path(".devshared/bench-data"), 20000, 0)'`, then delete its raw/); all three are
#   in .git/info/exclude. Then run `bash tools/device_check.sh` there, carrying .whl and .devshared.
#   A dry run on CPU (tiny sizes, same code paths): PYTHON=.venv/bin/python OUT=/tmp/dc bash tools/device_check.sh cpu
set -uo pipefail
MODE=${1:-gpu}
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder for logs and results}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$SECONDS
stamp() { echo "== $(date -u +%H:%M:%S) (+$((SECONDS - T0)) s) $*"; }

if ! $PY -c "import webdataset, zstandard" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -e ../shared/data/lifeseq-sample ]; then  # the tests read the sample where CI lays it
  mkdir -p ../shared/data && ln -s "$PWD/.devshared/lifeseq-sample" ../shared/data/lifeseq-sample
fi
DATA=.devshared/bench-data/shards
if [ ! -e "$DATA/manifest.json" ]; then
  stamp "no carried bench data: synthesising it"
  $PY -c 'import sys; sys.path.insert(0, "tools"); from pathlib import Path; from train_bench import synth_dataset
synth_dataset(Path(".devshared/bench-data"), 20000, 0)'
fi

if [ "$MODE" = cpu ]; then  # the same stages at sizes a 2-core CPU runs in minutes
  SWEEP=(--sizes small --lengths 64 --batch-sizes 4 --precisions 32-true --workers 1 --steps 4 --warmup 2
         --compile off --budget-s 120)
  KERNELS=(--batch-size 8 --max-len 64 --reps 2)
  T_SWEEP=600 T_KERNELS=600
else
  SWEEP=(--budget-s "${SWEEP_BUDGET:-165}")  # no point starts after this; T_SWEEP kills a point that overruns
  KERNELS=(--batch-size 256 --max-len 512 --reps 20)
  T_SWEEP=${T_SWEEP:-240} T_KERNELS=70
fi

stamp env
{ nvidia-smi || true; nproc; df -h /dev/shm
  $PY -c "import torch, lightning; from lifeseq_shards import model
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)
print('varlen_attn:', model._VARLEN_ATTN is not None)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stamp "pytest -m cuda"
timeout 80 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_varlen.py tests/test_device.py \
  tests/test_masking.py >"$OUT/tests.log" 2>&1
echo "tests exit $?: $(tail -1 "$OUT/tests.log")"

stamp "train_bench --preset varlen"
timeout "$T_SWEEP" $PY tools/train_bench.py --preset varlen --out "$OUT" --data "$DATA" --no-plots "${SWEEP[@]}"
echo "sweep exit $?"

stamp "bench_kernels"
timeout "$T_KERNELS" $PY tools/bench_kernels.py "$DATA" --out "$OUT" --parts attn,prep "${KERNELS[@]}"
echo "kernels exit $?"

stamp tables
$PY tools/varlen_tables.py "$OUT" >"$OUT/tables.md" && cat "$OUT/tables.md"
stamp done
