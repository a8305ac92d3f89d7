#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a lent GPU machine that has no network: the GPU-side tests
# (their CUDA cases run there), then the training sweep. Logs and results go to $OUT (8 files, the most that return).
#
#   Here, once: wheels of what that machine lacks into .whl/ (webdataset, braceexpand, zstandard for its Python)
#   and a copy of ../shared/data/lifeseq-sample into .devshared/ (both listed in .git/info/exclude); then run
#   `bash tools/device_check.sh gpu 240` there, carrying .whl and .devshared. A third argument, an earlier run's
#   results.csv (carried in .devshared), resumes that sweep: only the points it did not measure run.
#   A dry run on CPU: PYTHON=.venv/bin/python OUT=/tmp/dc bash tools/device_check.sh tiny 60
set -uo pipefail
PRESET=${1:-gpu}
BUDGET=${2:-240}
EARLIER=${3:-}
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder for logs and results}"
SWEEP=$(mktemp -d)

if ! $PY -c "import webdataset, zstandard" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ ! -e ../shared/data/lifeseq-sample ]; then  # the tests read the sample where CI lays it
  mkdir -p ../shared/data && ln -s "$PWD/.devshared/lifeseq-sample" ../shared/data/lifeseq-sample
fi

{ nvidia-smi || true; nproc; df -h /dev/shm
  $PY -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
} >"$OUT/env.txt" 2>&1

$PY -m pytest -q -p no:cacheprovider -rs tests/test_device.py tests/test_masking.py tests/test_train_bench.py \
  >"$OUT/tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/tests.log")"

RESUME=()
if [ -n "$EARLIER" ]; then cp "$EARLIER" "$SWEEP/results.csv" && RESUME=(--resume); fi
timeout $((BUDGET + 120)) $PY tools/train_bench.py --preset "$PRESET" --out "$SWEEP" --budget-s "$BUDGET" "${RESUME[@]}" \
  >"$OUT/sweep.log" 2>&1
echo "sweep exit $?: $(tail -1 "$OUT/sweep.log")"
cp "$SWEEP"/results.csv "$SWEEP"/results.md "$SWEEP"/*.png "$OUT"/ 2>/dev/null
sed -n '/^| size/,$p' "$SWEEP/results.md"
