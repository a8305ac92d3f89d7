#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a lent GPU machine that has no network. THE command:
#
#   bash tools/device_check.sh all       every stage below, most important first, in at most DEADLINE_S (480) s
#
# Stages, in order, each in a process of its own with its own deadline (cut to what is left of the whole), each
# writing its results as it goes: $OUT/seed/ (seed.jsonl, one line per point, seed.md, env.txt, log.txt) directly,
# the other stages into /tmp/device-check/<stage>/, packed into $OUT/stages.tgz after each stage (a lent machine
# returns 8 files at most), and everything as it ran in $OUT/log.txt. Budget on one lent H200 (seconds of the
# machine's time; the device tool also counts ~60-120 s to start the machine and the idle wait after the call):
#
#   stage   budget  what
#   setup      15   wheels into /tmp/site (carried .whl/), the sample link
#   seed      210   their pretrain.py, their loader against the diff's, 24 points in priority order (each ~15-25 s:
#                   process start, their data, 15 steps); the points past the budget are left, not half-run
#   pinned     10   their stack (torch 2.1.2 + Lightning 2.2.2): the lent machine has no such interpreter (its torch
#                   wheel is 2.5 GB, xformers 0.0.23.post1's 213 MB, past the 64 MiB a call carries): prints so and
#                   ends. Where PINNED_PYTHON exists (their cluster): give it B_PINNED=400
#   small     100   the masker's CUDA graph: the small preset's first points, its prep table, the CUDA tests
#   base       80   BERT-base at 1,024: the base preset's first points, the plain loop's CUDA tests
#   embed      60   the embedding writer at the large size, bf16 and fp32, verified (what is left of the 480)
#   their      90   their performer encoder padded to 512 against PackedPerformer (tools/bench_performer.py),
#                   train step and predict, fp32 + TF32 then bf16-mixed, small / medium / base, 256 persons
#   tokens    120   token-budget batches (train_bench --preset tokens: small-tc and large-tc, bf16, L=512: padded,
#                   padding-free by persons, by a budget eager and compiled with the graphed masker), then BERT-base
#                   at 1,024 by persons and by a budget; whatever is left of the 480 (it runs last)
#   total     480   + ~120 s start = ~10 min of the session's 15. The margin is for a partial rerun: every finished
#                   point and stage is kept, so a rerun on the still-warm machine (it goes back 30 s after a call)
#                   takes only what is missing, e.g. STAGES="small base" DEADLINE_S=200 with timeout_s=230
#   CPU dry run of `all-cpu` (tiny sizes, 2 cores shared with other jobs): docs/results/training-gpu.md, "The dry
#   run on CPU", has each stage's seconds
#
# Override: STAGES="seed small" (a subset, in the order given), B_SEED=... (a stage's budget), DEADLINE_S (the whole).
# The device tool's call (from the checkout the session started in; .whl and .devshared ignored there, prepared as
# below):  run(command="OUT=$OUT bash tools/device_check.sh all", carry=[".whl", ".devshared"], timeout_s=540)
#
#   Here, once: `THEIR_REPO=<their repository: a clone or the fetched mirror> bash tools/device_prep.sh` (its header
#   lists what it puts where): wheels of what that machine lacks into .whl/ (webdataset, braceexpand, zstandard for
#   its Python 3.12; performer-pytorch 1.1.4, local-attention 1.9.14, axial-positional-embedding 0.2.1 for their
#   model), the sample into .devshared/lifeseq-sample, the bench's 20,000 synthetic persons at 512 and 1,024 tokens
#   into .devshared/bench-data and bench-data-1024, and their code and data for the seed stage into .devshared/seed
#   (`python -m tools.seed_bench prepare`: their commit 884ef02 as it is and patched, 6,000 synthetic persons at 512
#   and 2,000 at 1,024 tokens as their encoded_mlm.h5 and as shards); both folders in .git/info/exclude, their size
#   checked against the 64 MiB a call carries. Their repository is never vendored.
#   Dry run of everything on CPU (tiny sizes, same code paths): PYTHON=.venv/bin/python PINNED_PYTHON=... OUT=/tmp/dc
#   DATA=<small shards> DATA1024=<small shards, 1,024> EMBED_DATA=<small shards> SEED_WORK=<seed_bench prepare
#   --persons 400 --lengths 64> SEED_DEPS=<their imports> SEED_DEPS_PINNED=<the same for the pins> bash \
#   tools/device_check.sh all-cpu   (tests/tools/test_seed_bench.py runs the seed stage's dry run where their
#   repository is)
#
# `bash tools/device_check.sh seed`: the seed stage alone: tools/seed_bench.py's plan with this Python,
# each point's row into $OUT/seed.jsonl as it finishes. Dry run: ... bash tools/device_check.sh seed-cpu
#
# `bash tools/device_check.sh` (no mode: gpu) is the first GPU run's check: the padded vs padding-free step. Into $OUT:
#   log.txt      everything below, as it ran (PYTHONUNBUFFERED)
#   env.txt      nvidia-smi, CPUs, torch/CUDA/Lightning versions, which varlen attention this torch has
#   tests.log    `pytest -m cuda`: the CUDA cases (flash varlen = padded model, prefetch, masking CPU = CUDA, ...)
#   results.csv, results.md   tools/train_bench.py --preset varlen (padded vs varlen, prefetch, compiled, seed sizes)
#   attn.csv, prep.csv        tools/bench_kernels.py (attention per head layout; batch prep, masker eager/graphed/
#                             compiled)
#   tables.md    tools/varlen_tables.py: the docs/results/training-gpu.md tables from the two above, ready to paste
#   A dry run on CPU (tiny sizes, same code paths): PYTHON=.venv/bin/python OUT=/tmp/dc bash tools/device_check.sh cpu
#
# `bash tools/device_check.sh small` runs only what decides the small-tc bars after two runs missed them,
# in at most DEADLINE_S (230) seconds from its start, wheel install included (every stage's timeout is cut to what
# is left): the `small` preset of train_bench (8 small-tc points: padded eager, then the padding-free step with the
# CUDA-graphed or compiled masker, the prefetch thread, the compiled model, ~2 minutes), bench_kernels' prep part
# (masker eager vs graphed vs compiled, the packed preparation with each), then `pytest -m cuda` on the masking and
# device tests, tables.
# Dry run: PYTHON=.venv/bin/python OUT=/tmp/dcs bash tools/device_check.sh small-cpu
#
# `bash tools/device_check.sh pinned` runs on the researchers' stack (constraints-pinned.txt: torch 2.1.2+cu121 from
# PyPI, Lightning 2.2.2, numpy 1.25.1) in the interpreter PINNED_PYTHON (default .venv-pinned/bin/python, which
# `make install-pinned` builds): `pytest -m cuda` (varlen, device, masking), then four sweep points, small-tc and
# large-tc, padded and padding-free (torch 2.1 has no varlen kernel: the padded-sdpa path), bf16, L=512, batch 256.
# Its torch is 2.5 GB, more than a lent machine takes along: that machine must already have it (PINNED_PYTHON).
# Dry run: OUT=/tmp/dcp bash tools/device_check.sh pinned-cpu
# `bash tools/device_check.sh embed`: the embedding stage (below), embed-cpu its dry run.
# `bash tools/device_check.sh base` measures BERT-base at 1,024 tokens in at most DEADLINE_S (430) seconds:
# train_bench's `base` preset (the researchers' BERT-base at batch 50, L=1,024 then 512, fp32 / tf32 / bf16, padded and padding-free;
# on .devshared/bench-data-1024, the bench's persons converted with --max-seq-len 1024, synthesised here if not
# carried) into $OUT/base, then the `batch` preset (small / medium and their -tc twins, batch 256-4,096, bf16) into
# $OUT/batch, then `pytest -m cuda` on the plain loop's tests. Dry run: ... bash tools/device_check.sh base-cpu
set -uo pipefail
MODE=${1:-gpu}
PY=${PYTHON:-python3}
case "$MODE" in pinned|pinned-cpu) PY=${PINNED_PYTHON:-.venv-pinned/bin/python};; esac
: "${OUT:?set OUT to the folder for logs and results}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$SECONDS
stamp() { echo "== $(date -u +%H:%M:%S) (+$((SECONDS - T0)) s) $*"; }
case "$MODE" in pinned|pinned-cpu) if ! command -v "$PY" >/dev/null; then
  echo "pinned: no interpreter $PY (set PINNED_PYTHON; a lent machine has none: torch 2.1.2 is too big to carry)"
  exit 2
fi;; esac
DEADLINE=$((T0 + ${DEADLINE_S:-230}))
cap() { local left=$((DEADLINE - SECONDS - ${2:-0})); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }  # cap T [RESERVE]

if ! $PY -c "import webdataset, zstandard" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -e ../shared/data/lifeseq-sample ]; then  # the tests read the sample where CI lays it
  mkdir -p ../shared/data && ln -s "$PWD/.devshared/lifeseq-sample" ../shared/data/lifeseq-sample
fi
DATA=${DATA:-.devshared/bench-data/shards}  # DATA=...: another converted dataset (a dry run's small one)
case "$MODE" in all|all-cpu|seed|seed-cpu|their|their-cpu) ;;  # these read their own data; `all`'s stages see to theirs
*) if [ ! -e "$DATA/manifest.json" ]; then
  stamp "no carried bench data: synthesising it"
  $PY -c 'from pathlib import Path; from tools.common import synth_dataset
synth_dataset(Path(".devshared/bench-data"), 20000, 0)'
fi;;
esac

case "$MODE" in all|all-cpu)  # every stage, most important first; the budget is the header's
  SUFFIX=${MODE#all}
  DEADLINE=$((T0 + ${DEADLINE_S:-480}))
  [ -n "$SUFFIX" ] && DEADLINE=$((T0 + ${DEADLINE_S:-7200}))  # a dry run: each stage's own CPU deadline
  WORK=${WORK:-/tmp/device-check}
  rm -rf "$WORK" && mkdir -p "$WORK"
  export DATA PYTHONUNBUFFERED  # PYTHONPATH (the wheels, this checkout) is exported above
  for STAGE in ${STAGES:-seed pinned small base embed their tokens}; do
    VAR=B_${STAGE^^}
    case "$STAGE" in seed) B=210;; pinned) B=10;; small) B=100;; base) B=80;; embed) B=60;; their) B=90;;
      tokens) B=120;; *) B=60;;
    esac
    B=${!VAR:-$B}
    [ -n "$SUFFIX" ] && B=${!VAR:-1800}  # CPU dry runs: minutes per stage on 2 shared cores
    LEFT=$((DEADLINE - SECONDS))
    if [ "$LEFT" -lt 10 ]; then stamp "$STAGE: skipped, the run's deadline is spent"; continue; fi
    B=$((B < LEFT ? B : LEFT))
    DIR=$WORK/$STAGE
    [ "$STAGE" = seed ] && DIR=$OUT/seed  # its rows come back even if the call is cut short
    mkdir -p "$DIR"
    stamp "stage $STAGE: $B s"
    OUT=$DIR DEADLINE_S=$B timeout -k 5 $((B + 20)) bash "$0" "$STAGE$SUFFIX"
    stamp "stage $STAGE: exit $? after $((SECONDS - T0)) s of the run"
    tar czf "$OUT/stages.tgz.tmp" -C "$WORK" . && mv "$OUT/stages.tgz.tmp" "$OUT/stages.tgz"
  done
  stamp done
  exit 0;;
esac

case "$MODE" in seed|seed-cpu)  # their pretrain.py, their loader against the diff's (tools/seed_bench.py)
  SEED=${SEED_WORK:-.devshared/seed}
  if [ ! -e "$SEED/patched" ]; then
    echo "seed: no $SEED/patched: run \`python -m tools.seed_bench prepare THEIR_REPO --work $SEED\` first"
    exit 2
  fi
  if [ "$MODE" = seed-cpu ]; then
    RUN=(--plan cpu --steps 4 --warmup 2 --point-timeout-s 300 --min-point-s 5)
    DEADLINE=$((T0 + ${DEADLINE_S:-900}))
  else
    RUN=(--plan gpu --steps 15 --warmup 5 --point-timeout-s 60 --min-point-s 15)
    DEADLINE=$((T0 + ${DEADLINE_S:-210}))
  fi
  { nvidia-smi --query-gpu=name,memory.total --format=csv || true; nproc
    $PY -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytorch_lightning', pl.__version__)"
  } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  stamp "seed_bench: their loader, then the diff's, point by point"
  timeout -k 5 "$(cap 100000 3)" $PY -m tools.seed_bench run --work "$SEED" --out "$OUT" --runs /tmp/seed-runs \
    --python "$PY" --stack "${SEED_STACK:-newest}" --budget-s "$(cap 100000 5)" "${RUN[@]}" \
    ${SEED_DEPS:+--deps "$SEED_DEPS"}
  echo "seed exit $?"
  stamp done
  exit 0;;
esac

case "$MODE" in pinned|pinned-cpu)
  if ! $PY -c "import sys, torch, lightning; sys.exit(not torch.__version__.startswith('2.1.'))"; then
    echo "pinned: $PY has no torch 2.1: set PINNED_PYTHON to an interpreter with constraints-pinned.txt installed"
    exit 2
  fi
  if [ "$MODE" = pinned-cpu ]; then  # the same stages and points at sizes a 2-core CPU runs
    SWEEP=(--sizes small-tc --lengths 64 --batch-sizes 4 --precisions 32-true --workers 1 --steps 4 --warmup 2)
  else
    SWEEP=(--sizes small-tc,large-tc --lengths 512 --batch-sizes 256 --precisions bf16-mixed --steps 30 --warmup 5
           --budget-s 150)
  fi
  { nvidia-smi --query-gpu=name,memory.used --format=csv || true; nproc
    $PY -c "import torch, lightning, numpy; from lifeseq_shards import compat
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'numpy', numpy.__version__)
print('uint16 tensors:', compat.unsigned_tensors(), 'varlen_attn:', compat.varlen_kernel() is not None)"
  } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  [ "$MODE" = pinned-cpu ] && DEADLINE=$((T0 + ${DEADLINE_S:-2400})) || DEADLINE=$((T0 + ${DEADLINE_S:-600}))
  stamp "pytest -m cuda (torch 2.1)"
  timeout "$(cap 120 60)" $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_varlen.py \
    tests/device/test_device.py tests/test_masking.py >"$OUT/tests.log" 2>&1
  echo "tests exit $?: $(tail -1 "$OUT/tests.log")"
  # their own training on their stack: tools/seed_bench.py's points with this interpreter; the packed
  # attention runs xformers' block-diagonal kernel where SEED_DEPS_PINNED (or the env) holds xformers 0.0.23.post1
  stamp "seed_bench on torch 2.1"
  mkdir -p "$OUT/seed"
  PYTHON=$PY SEED_STACK=pinned SEED_DEPS=${SEED_DEPS_PINNED:-} OUT=$OUT/seed DEADLINE_S=$(cap 100000 60) \
    bash "$0" "seed${MODE#pinned}"
  stamp "train_bench: padded and padding-free (torch 2.1)"
  timeout "$(cap 240 1)" $PY -m tools.train_bench --preset tiny --out "$OUT" --data "$DATA" --no-plots "${SWEEP[@]}" \
    --attention padded,varlen --prefetch off --prefetch-thread off --compile off
  echo "sweep exit $?"
  stamp done
  exit 0;;
esac

case "$MODE" in embed|embed-cpu)  # the reference model at the seed's `large` sizes embeds the bench data
  # on one GPU, bf16 autocast then fp32, through EmbeddingWriter (packed batches, padding-free path); each output
  # verified, and the two precisions compared (cosine of each person's CLS and mean). About 2 minutes on one H200.
  # Dry run: PYTHON=.venv/bin/python OUT=/tmp/dce EMBED_DATA=<a few hundred persons> DEADLINE_S=900 \
  #   bash tools/device_check.sh embed-cpu
  if [ "$MODE" = embed-cpu ]; then  # T_EMB: 180 s did not embed 600 persons on 2 cores shared with other jobs
    EMB=(--device cpu --size small --workers 1) T_EMB=900
  else
    EMB=(--device cuda --size large --workers 4) T_EMB=180
  fi
  WORK=/tmp/embed-work DATA=${EMBED_DATA:-$DATA}  # EMBED_DATA: a smaller dataset for the dry run
  { nvidia-smi --query-gpu=name,memory.used --format=csv || true; nproc
    $PY -c "import torch, lightning, pyarrow; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'pyarrow', pyarrow.__version__)"
  } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  stamp "bench_embed ${EMB[*]}"
  timeout "$(cap "$T_EMB" 30)" $PY -m tools.bench_embed "${EMB[@]}" --data "$DATA" --work "$WORK" --out "$OUT"
  echo "embed exit $?"
  for P in bf16 fp32; do
    stamp "verify $P"
    timeout "$(cap 30 5)" $PY -m lifeseq_shards.cli embeddings verify "$WORK/device-${EMB[3]}-$P" --data "$DATA"
    echo "verify $P exit $?"
  done
  stamp "bf16 against fp32"
  timeout "$(cap 30 2)" $PY - "$WORK/device-${EMB[3]}" <<'PYEOF'
import sys
import numpy as np, pyarrow.dataset as ds
a, b = (ds.dataset(f"{sys.argv[1]}-{p}").to_table().sort_by("person_id") for p in ("bf16", "fp32"))
assert a.column("person_id").equals(b.column("person_id"))
for name in ("cls", "mean"):
    x, y = (np.stack(t.column(name).to_numpy(zero_copy_only=False)).astype(np.float64) for t in (a, b))
    cos = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-12)
    print(f"{name}: cosine bf16 vs fp32 min {cos.min():.4f} median {np.median(cos):.5f} over {len(cos)} persons")
PYEOF
  stamp done
  exit 0;;
esac

case "$MODE" in their|their-cpu)  # their performer encoder padded to 512 against PackedPerformer, both precisions
  # tools/bench_performer.py: their train step and predict pass, the sides alternating round by round, on the sample's
  # lengths and a long tail; one page per precision, performer-<precision>.md. Sizes, each defaulting to the mode's:
  # THEIR_SIZES (tools/their_encoder.py's SIZES, comma-separated), THEIR_POPULATIONS (sample,long-tail),
  # THEIR_PERSONS, THEIR_BATCH (persons a padded step), THEIR_ROUNDS. Dry run (tiny dims, a few persons, the same
  # code paths; THEIR_PERSONS=2 THEIR_BATCH=1 is tests/tools/test_bench_performer.py's, seconds):
  #   PYTHON=.venv/bin/python OUT=/tmp/dct bash tools/device_check.sh their-cpu
  # Exit: 2 without their dependencies or with a size the bench refuses, else the first precision's failure (124: cut
  # by the deadline), else 0.
  if [ "$MODE" = their-cpu ]; then
    DEFAULTS=(cpu tiny sample 6 2 1)
    DEADLINE=$((T0 + ${DEADLINE_S:-900}))
  else
    DEFAULTS=(cuda small,medium,base sample,long-tail 256 32 3)
    DEADLINE=$((T0 + ${DEADLINE_S:-90}))
  fi
  BENCH=(--device "${DEFAULTS[0]}" --sizes "${THEIR_SIZES:-${DEFAULTS[1]}}" --populations
    "${THEIR_POPULATIONS:-${DEFAULTS[2]}}" --persons "${THEIR_PERSONS:-${DEFAULTS[3]}}" --batch
    "${THEIR_BATCH:-${DEFAULTS[4]}}" --rounds "${THEIR_ROUNDS:-${DEFAULTS[5]}}")
  { nvidia-smi --query-gpu=name,memory.used --format=csv || true; nproc
    $PY -c "import torch, performer_pytorch, local_attention; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  } >"$OUT/env.txt" 2>&1
  DEPS=$?  # the import line's: the last of the group
  stamp env; cat "$OUT/env.txt"
  if [ "$DEPS" -ne 0 ]; then
    echo "their: $PY cannot import torch, performer_pytorch and local_attention (their model's dependencies; the" \
      "wheels: tools/device_prep.sh puts them into .whl/)"
    exit 2
  fi
  SHARE=2  # the first precision gets half of the stage's time, the second what is left
  RC=0
  for P in tf32 bf16-mixed; do  # fp32 with TF32 matmuls (their PRECISION "32-true" + "medium"), then bf16 autocast
    stamp "bench_performer $P"
    timeout "$(cap $(((DEADLINE - SECONDS) / SHARE)) 2)" $PY -m tools.bench_performer "${BENCH[@]}" --precision "$P" \
      --out "$OUT/performer-$P.md"
    STATUS=$?
    echo "their $P exit $STATUS"
    [ "$STATUS" -eq 2 ] && exit 2  # the bench refused an argument (a size): the other precision would too
    [ "$RC" -eq 0 ] && RC=$STATUS
    SHARE=1
  done
  stamp done
  exit "$RC";;
esac

case "$MODE" in base|base-cpu)
  DATA1024=${DATA1024:-.devshared/bench-data-1024/shards}  # DATA1024=...: a dry run's small one
  if [ ! -e "$DATA1024/manifest.json" ]; then
    stamp "no carried 1,024-token bench data: synthesising it"
    $PY -c 'from pathlib import Path; from tools.common import synth_dataset
synth_dataset(Path(".devshared/bench-data-1024"), 20000, 0, max_seq_len=1024)'
  fi
  if [ "$MODE" = base-cpu ]; then  # the same stages and code paths at sizes a 2-core CPU runs
    BASE=(--lengths 64 --batch-sizes 2 --precisions 32-true --steps 3 --warmup 1 --workers 1)
    BATCH=(--sizes small-tc --lengths 64 --batch-sizes 4,8 --steps 3 --warmup 1 --workers 1)
    DEADLINE=$((T0 + ${DEADLINE_S:-2400})) T_BASE=1200 T_BATCH=600 T_TESTS=600
  else
    BASE=() BATCH=()
    DEADLINE=$((T0 + ${DEADLINE_S:-430})) T_BASE=260 T_BATCH=200 T_TESTS=40
  fi
  { nvidia-smi --query-gpu=name,memory.total --format=csv || true; nproc
    $PY -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  stamp "train_bench --preset base"
  timeout "$(cap "$T_BASE" 150)" $PY -m tools.train_bench --preset base --out "$OUT/base" --data "$DATA1024" \
    --no-plots --budget-s "$(cap $((T_BASE - 30)) 160)" ${BASE[@]+"${BASE[@]}"}
  echo "base sweep exit $?"
  stamp "train_bench --preset batch"
  timeout "$(cap "$T_BATCH" 20)" $PY -m tools.train_bench --preset batch --out "$OUT/batch" --data "$DATA" \
    --no-plots --budget-s "$(cap $((T_BATCH - 30)) 30)" ${BATCH[@]+"${BATCH[@]}"}
  echo "batch sweep exit $?"
  stamp "pytest -m cuda (plain loop, 1,024 tokens)"
  timeout "$(cap "$T_TESTS" 1)" $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_loop.py tests/test_base_1024.py \
    >>"$OUT/tests.log" 2>&1
  echo "tests exit $?: $(tail -1 "$OUT/tests.log")"
  stamp done
  exit 0;;
esac

case "$MODE" in tokens|tokens-cpu)  # token-budget batches against batches of persons (train_bench --preset tokens)
  DATA1024=${DATA1024:-.devshared/bench-data-1024/shards}
  if [ "$MODE" = tokens-cpu ]; then  # the same points at sizes a 2-core CPU runs; the crop (64) bounds the budget
    SWEEP=(--sizes small-tc --lengths 64 --batch-sizes 4 --precisions 32-true --workers 1 --steps 4 --warmup 2
           --compile off --masker eager --tokens-per-batch 0,600 --budget-s 300)
    BASE=(--sizes small-tc --lengths 128 --batch-sizes 2 --precisions 32-true --workers 1 --steps 3 --warmup 1
          --tokens-per-batch 0,800 --budget-s 300)
    DEADLINE=$((T0 + ${DEADLINE_S:-1800}))
  else
    SWEEP=(--budget-s "${SWEEP_BUDGET:-80}")
    # BERT-base at 1,024 (their newest): 50 persons, or the tokens 50 mean persons of the 1,024 data hold
    BASE=(--sizes base --lengths 1024 --batch-sizes 50 --precisions bf16-mixed --attention varlen --prefetch on
          --tokens-per-batch 0,20000 --steps 20 --warmup 5 --budget-s 40)
  fi
  { nvidia-smi --query-gpu=name,memory.used --format=csv || true; nproc; } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  stamp "train_bench --preset tokens"
  timeout "$(cap 160 45)" $PY -m tools.train_bench --preset tokens --out "$OUT" --data "$DATA" --no-plots "${SWEEP[@]}"
  echo "sweep exit $?"
  stamp "train_bench base at 1,024, by persons and by a budget"
  timeout "$(cap 60 5)" $PY -m tools.train_bench --preset tokens --out "$OUT/base" --data "$DATA1024" --no-plots \
    "${BASE[@]}"
  echo "base exit $?"
  stamp done
  exit 0;;
esac

case "$MODE" in small|small-cpu)
  if [ "$MODE" = small-cpu ]; then  # the same stages and points at sizes a 2-core CPU runs (no compile: minutes)
    SWEEP=(--sizes small-tc --lengths 64 --batch-sizes 4 --precisions 32-true --workers 1 --steps 4 --warmup 2
           --compile off --masker eager,graphed --budget-s 60)
    KERNELS=(--batch-size 8 --max-len 64 --reps 2)
    DEADLINE=$((T0 + ${DEADLINE_S:-1800})) T_PREP=900  # inductor's C++ compiles of the masker take minutes here
  else
    SWEEP=(--budget-s "${SWEEP_BUDGET:-100}")  # no point starts after this: leaves the prep its ~30-45 s
    KERNELS=(--batch-size 256 --max-len 512 --reps 20)
    T_PREP=45
  fi
  { nvidia-smi --query-gpu=name,memory.used --format=csv || true; nproc
    $PY -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  } >"$OUT/env.txt" 2>&1
  stamp env; cat "$OUT/env.txt"
  stamp "train_bench --preset small"
  timeout "$(cap 160 45)" $PY -m tools.train_bench --preset small --out "$OUT" --data "$DATA" --no-plots "${SWEEP[@]}"
  echo "sweep exit $?"
  if [ "$MODE" = small-cpu ]; then  # every lever at once (one point, smallest size), so the compiled path is dry-run
    timeout "$(cap 900 45)" $PY -m tools.train_bench --preset small --out "$OUT/compiled" --data "$DATA" --no-plots \
      --sizes small-tc --lengths 32 --batch-sizes 2 --precisions 32-true --workers 1 --steps 3 --warmup 1 \
      --attention varlen --prefetch on --prefetch-thread on --compile on --masker compiled
    echo "compiled sweep exit $?"
  fi
  stamp "bench_kernels prep"
  timeout "$(cap "$T_PREP" 25)" $PY -m tools.bench_kernels "$DATA" --out "$OUT" --parts prep "${KERNELS[@]}"
  echo "kernels exit $?"
  stamp "pytest -m cuda (masking, device)"  # the compiled masker's tests last: inductor may take most of the time
  for PICK in "not compiled_masker" "compiled_masker"; do
    timeout "$(cap 40 3)" $PY -m pytest -q -p no:cacheprovider -rs -m cuda -k "$PICK" tests/test_masking.py \
      tests/device/test_device.py >>"$OUT/tests.log" 2>&1
    echo "tests ($PICK) exit $?: $(tail -1 "$OUT/tests.log")"
  done
  stamp tables
  $PY -m tools.varlen_tables "$OUT" >"$OUT/tables.md" && cat "$OUT/tables.md"
  stamp done
  exit 0;;
esac

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
  $PY -c "import torch, lightning; from lifeseq_shards import compat
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)
print('varlen_attn:', compat.varlen_kernel() is not None)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stamp "pytest -m cuda"
timeout 80 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_varlen.py tests/device/test_device.py \
  tests/test_masking.py >"$OUT/tests.log" 2>&1
echo "tests exit $?: $(tail -1 "$OUT/tests.log")"

stamp "train_bench --preset varlen"
timeout "$T_SWEEP" $PY -m tools.train_bench --preset varlen --out "$OUT" --data "$DATA" --no-plots "${SWEEP[@]}"
echo "sweep exit $?"

stamp "bench_kernels"
timeout "$T_KERNELS" $PY -m tools.bench_kernels "$DATA" --out "$OUT" --parts attn,prep "${KERNELS[@]}"
echo "kernels exit $?"

stamp tables
$PY -m tools.varlen_tables "$OUT" >"$OUT/tables.md" && cat "$OUT/tables.md"
stamp done
