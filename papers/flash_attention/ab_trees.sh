#!/usr/bin/env bash
# A/B of two source trees on one GPU, in one device call: each tree's own mosaic_bench.py (--only per configuration,
# bf16) and variants.py (a subset), each in its own process, alternating trees per configuration so drift hits both.
# Usage (repository root, GPU machine): TREES="baseline ." CONFIGS="128,8192,1 128,8192,0" \
#   VARIANTS=causal,window,document,softcap,alibi bash papers/flash_attention/ab_trees.sh
# A tree is a directory holding napkin_cat/, rewrites/, lowering/ and papers/flash_attention/ (e.g. a `git archive`
# of the commit compared). Every time is the wall clock (wall_clock.py), as a tree from before the CUPTI timer
# measures. Logs and JSON go to $OUT/<tree>/.
set -uo pipefail
OUT=${OUT:-ab_out}; TREES=${TREES:-"baseline ."}; CONFIGS=${CONFIGS:-"128,8192,1 128,8192,0"}
VARIANTS=${VARIANTS-causal,window,document,softcap,alibi}
export PYTHONUNBUFFERED=1
root=$PWD
case $OUT in /*) ;; *) OUT=$root/$OUT ;; esac  # the runs below start in each tree
for cfg in $CONFIGS; do
  for t in $TREES; do
    name=$(basename "$(cd "$t" && pwd)"); mkdir -p "$OUT/$name"
    echo "== $name mosaic_bench --only $cfg"
    (cd "$t" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "${BENCH_S:-200}" python3 "$root/papers/flash_attention/wall_clock.py" papers/flash_attention/mosaic_bench.py \
      --only "$cfg" --dtypes bf16 --out "$OUT/$name" 2>&1 | tee -a "$OUT/$name/mosaic.log" | grep -E "TFLOP|÷|ratio|^\|" | tail -30)
  done
done
for t in $TREES; do
  [ -n "$VARIANTS" ] || break  # VARIANTS= empty: the Mosaic configurations only
  name=$(basename "$(cd "$t" && pwd)"); mkdir -p "$OUT/$name"
  echo "== $name variants $VARIANTS"
  (cd "$t" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "${VARIANTS_S:-240}" python3 "$root/papers/flash_attention/wall_clock.py" -m papers.flash_attention.variants \
    --variants "$VARIANTS" --no-plot --out "$OUT/$name" 2>&1 | tee "$OUT/$name/variants.log" | tail -25)
done
