#!/usr/bin/env bash
# The checks only a CUDA GPU can make (CI has none), in one go, for results/gpu.md:
#   1. the method contract on CUDA (tests/test_gpu.py)  -> $OUT/tests.log
#   1b. Ray's GPU workers (tests/test_gpu_ray.py: --ray --device cuda build and run equal one process on the GPU,
#      a GPU worker killed mid-batch)  -> $OUT/ray.log; needs Ray (its wheel in .whl/ on a bare machine)
#   1c. one chunk's entry built through EntryBuilder on the GPU, bfloat16 and float32 compute (scripts/bench_gpu_build.py:
#      the per-chunk cost results/scale.md's projection reads)  -> $OUT/build.md, $OUT/build.json
#   2. kvfuse's TTFT against ProphetKV's at 15%, paired round by round, on Llama-3-8B's shape with random
#      weights (issue 17: "no worse than prophetkv at the same ratio")  -> $OUT/kvfuse/
#   3. `verify` of the GPU results files (expected.yaml's `requires: cuda` entries): re-runs results/gpu.md's
#      bench at this commit and checks its committed numbers  -> $OUT/verify.log, $OUT/verify-ttft.md
# STEPS picks some of them (default: tests ray build bench verify); VERIFY_ONLY the results files step 3 re-runs.
#
# On a GPU machine with kvf installed: `bash scripts/gpu_checks.sh`. On a bare machine that has torch and
# transformers but not kvf's other dependencies, put their wheels in .whl/ first: they are installed to
# /tmp/site, and this checkout is imported as `kvf` through a link (the repository root is the package).
# DEVICE, SHAPE, LENGTHS and REPEATS exist so that the script itself can be tried on a CPU (tiny shape).
set -uo pipefail
OUT=${OUT:-results/gpu}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama3-8b}
LENGTHS=${LENGTHS:-4096,16384}
REPEATS=${REPEATS:-12}
STEPS=${STEPS:-tests ray build bench verify}
VERIFY_ONLY=${VERIFY_ONLY:-results/gpu.md}
mkdir -p "$OUT/kvfuse"

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import kvf.cli.entry" 2>/dev/null; then
  mkdir -p /tmp/kvf-link && ln -sfn "$PWD" /tmp/kvf-link/kvf
  export PYTHONPATH=/tmp/kvf-link${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

{ git rev-parse HEAD 2>/dev/null; nvidia-smi -L 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"

step() { [[ " $STEPS " == *" $1 "* ]]; }

if step tests; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/tests.log"
fi

if step ray; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu_ray.py 2>&1 | tee "$OUT/ray.log"
fi

step build && python3 -m kvf.scripts.bench_gpu_build --random-weights "$SHAPE" --device "$DEVICE" --out "$OUT/build.md"

step bench && python3 -m kvf bench --random-weights "$SHAPE" --device "$DEVICE" -m full,prophetkv,kvfuse,kvfuse:propagate=off \
  --lengths "$LENGTHS" -r 0.15 --repeats "$REPEATS" --versus prophetkv --no-cold --no-compare-no-pipeline \
  --no-auto-ratio --out "$OUT/kvfuse"

if step verify; then
  # verify runs `kvf ...` commands through $KVF: here, this python3 with this checkout on its path
  printf '#!/bin/sh\nexec python3 -m kvf "$@"\n' > /tmp/kvf-cmd && chmod +x /tmp/kvf-cmd
  rm -rf /tmp/kvf-gpu-verify
  KVF=/tmp/kvf-cmd python3 -m kvf.scripts.verify --only $VERIFY_ONLY --keep /tmp/kvf-gpu-verify 2>&1 | tee "$OUT/verify.log"
  find /tmp/kvf-gpu-verify -name ttft.md -exec cp {} "$OUT/verify-ttft.md" \;
fi
