#!/usr/bin/env bash
# One device call: the GPU tests, the main job on its default example, and the forward / forward+backward benchmark
# against cuDNN, jax's Pallas kernels and XLA, in one process per step. Run from the repository root on a GPU machine
# with jax 0.11.2; wheels for what the machine lacks (discopy, tokamax and its needs) in .whl/. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo "get_kernel_stats_tool = None" > /tmp/site/xprof/cli/tools.py  # tokamax imports it; profiling is unused
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== gpu tests"; timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== main job"; timeout "${MAIN_S:-90}" python3 -m napkin_cat --out "$OUT/main" 2>&1 | tee "$OUT/main_job.log" | tail -30
echo "== benchmark"; timeout "${BENCH_S:-260}" python3 -m papers.flash_attention.benchmark --candidate=napkin --dtypes=bf16 \
  --sections=fwd,fwdbwd --head-dims 64,128 --fwdbwd-head-dims 64,128 --seq-lens 2048,8192 --causal both \
  --budget-s "$(( ${BENCH_S:-260} - 30 ))" --out-dir "$OUT" 2>&1 | tee "$OUT/benchmark.log" | tail -40
