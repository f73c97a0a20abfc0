#!/usr/bin/env bash
# The GPU check, for the day a CUDA machine is at hand (README, "Tests and checks"): the gpu-marked
# tests, the calibration pass on CUDA against update_bn and a plain eval forward (resnet50
# at 224, batch 128), and device-side JPEG decode, ending with one table. Under 8 minutes
# on one GPU. Where there is no CUDA device it says so and exits 0.
#
#   bench/gpu_check.sh            # PYTHON=... to pick the interpreter; GPU_CHECK_OUT=dir keeps the logs
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT_DIR=${GPU_CHECK_OUT:-$(mktemp -d -t bnrecal-gpu-check.XXXXXX)}
mkdir -p "$OUT_DIR"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"
    exit 0
fi
"$PYTHON" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'
# The tests first: a failure there is the first thing to fix. Only the modules that hold gpu-marked
# tests are collected (quicker, and what the rest of the suite imports need not be there). Each test
# is bounded, and so is the whole.
mapfile -t files < <(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | sort)
timeout 200 "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q --timeout 150 -o addopts="-ra --strict-markers" "${files[@]}" \
    --junitxml "$OUT_DIR/gpu-tests.xml" 2>&1 | tee "$OUT_DIR/gpu-tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}
timeout 180 "$PYTHON" bench/gpu_check.py --tests "$OUT_DIR/gpu-tests.xml" --json "$OUT_DIR/gpu-check.json" \
    --profile "$OUT_DIR/calibration-profile.txt" \
    2>&1 | tee "$OUT_DIR/gpu-check.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc; logs in $OUT_DIR"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
