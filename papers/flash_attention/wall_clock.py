"""Run a benchmark script or module with every ``time_calls`` on the wall clock: an A/B against a tree whose
benchmarks predate the CUPTI timer (``ab_trees.sh``) then compares like with like.

    python papers/flash_attention/wall_clock.py papers/flash_attention/mosaic_bench.py --only 128,8192,1
    python papers/flash_attention/wall_clock.py -m papers.flash_attention.variants --variants causal

Run from the tree whose benchmark it runs (its ``papers`` package is imported from the working directory); in a
tree without ``papers/flash_attention/timing.py`` it runs the script unchanged.
"""

import runpy
import sys

sys.path.insert(0, ".")
try:
    import papers.flash_attention.timing as timing
except ImportError:  # a tree from before the one timing helper: its scripts time on the wall clock already
    timing = None
if timing is not None:
    measured = timing.time_calls
    timing.time_calls = lambda *a, **k: measured(*a, **{**k, "method": "wall"})

if sys.argv[1] == "-m":
    name, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
else:
    path, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
