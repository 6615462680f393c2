"""Benchmark results as JSON, markdown tables, a plot, and the README section they regenerate.

A results dict (see ``benchmark.run``) holds ``forward`` and ``forward_backward`` entries — one per
configuration, each with a record per implementation (``status``, ``tflops``, ``time_ms``,
``max_rel_err``, ``temp_bytes``, ``peak_bytes``) — and a ``longest`` sweep.

>>> ok = {"status": "ok", "tflops": 400.0, "time_ms": 1.0, "max_rel_err": 2e-3}
>>> entry = {"config": {"dtype": "bf16", "head_dim": 128, "seq": 8192, "batch": 2, "causal": False},
...          "results": {"candidate": ok, "mha": dict(ok, tflops=200.0, time_ms=2.0),
...                      "cudnn": {"status": "unavailable", "error": "needs a CUDA GPU"}},
...          "speedup": {"mha": 2.0}}
>>> print(forward_table([entry]))
| dtype | D | N | B | causal | candidate | mha | cand. err | cand. ÷ mha |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| bf16 | 128 | 8192 | 2 | no | 400 | 200 | 2.0e-03 | 2.00× |
<BLANKLINE>
Not run here: cudnn — needs a CUDA GPU.
"""

from __future__ import annotations

import json
import os
import traceback
from collections import Counter
from pathlib import Path

ORDER = ("candidate", "naive", "cudnn", "mha", "mgpu")
NAMES = {
    "candidate": "candidate (napkin-cat, or the stand-in named above)",
    "naive": "naive XLA: einsum, f32 softmax, einsum",
    "cudnn": "`jax.nn.dot_product_attention(implementation='cudnn')`",
    "mha": "jax's Pallas Triton `mha` (default blocks)",
    "mgpu": "jax's Pallas Mosaic GPU `attention_mgpu` (FA3-style, fp16)",
}
COLOURS = dict(zip(ORDER, ("tab:blue", "tab:gray", "tab:green", "tab:orange", "tab:purple"), strict=True))
BEGIN, END = "<!-- {}:begin -->", "<!-- {}:end -->"


def describe_error(e: BaseException) -> str:
    """The first line of an exception, with where it was raised when it says nothing else.

    >>> describe_error(ValueError("bad block\\nmore"))
    'ValueError: bad block'
    """
    first = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    if first.endswith(":") and e.__traceback__:  # e.g. a bare assertion
        frame = traceback.extract_tb(e.__traceback__)[-1]
        first += f" at {Path(frame.filename).name}:{frame.lineno}"
    return first[:400]


def save_json(res: dict, path: Path) -> None:
    """Write ``res`` to ``path`` (creating its folder), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(path)


def _columns(entries: list) -> tuple[list, dict]:
    """Implementations that ran somewhere, in ORDER; the rest with why they did not."""
    seen = {name: r for e in entries for name, r in e["results"].items()}
    ran = [n for n in ORDER if n in seen and any(e["results"].get(n, {}).get("status", "unavailable")
                                                  != "unavailable" for e in entries)]
    absent = {n: r.get("error", "") for n, r in seen.items() if n not in ran}
    return ran, absent


def _cell(r: dict | None) -> str:
    if not r:
        return "–"
    if r["status"] != "ok":
        return {"unavailable": "n/a"}.get(r["status"], r["status"])
    return f"{r['tflops']:.0f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}"


def _row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def forward_table(entries: list) -> str:
    """TFLOP/s per implementation, the candidate's error and its speedups, one row per config."""
    ran, absent = _columns(entries)
    others = [n for n in ran if n != "candidate"]
    head = ["dtype", "D", "N", "B", "causal", *ran, "cand. err", *(f"cand. ÷ {n}" for n in others)]
    lines = [_row(head), _row(["---"] * len(head))]
    for e in entries:
        c, res = e["config"], e["results"]
        err = res.get("candidate", {}).get("max_rel_err")
        lines.append(_row([c["dtype"], c["head_dim"], c["seq"], c["batch"], "yes" if c["causal"] else "no",
                           *(_cell(res.get(n)) for n in ran),
                           f"{err:.1e}" if err is not None else "–",
                           *(f"{e['speedup'][n]:.2f}×" if n in e["speedup"] else "–" for n in others)]))
    if absent:
        lines += ["", "Not run here: " + "; ".join(f"{n} — {why}" for n, why in absent.items()) + "."]
    failures = Counter((n, r.get("error", "")[:160].replace("|", "/")) for e in entries for n in ran
                       if (r := e["results"].get(n, {})).get("status") in ("error", "oom"))
    lines += [f"\nFailed, {n} ({count} rows): `{msg}`" for (n, msg), count in failures.items()]
    return "\n".join(lines)


def longest_table(longest: dict) -> str:
    """The longest N each implementation ran at, its speed there, and what stopped it.

    >>> print(longest_table({"config": {"dtype": "bf16", "heads": 8, "head_dim": 128, "causal": False},
    ...     "max_tried": 131072, "results": {"naive": {"max_n": 16384, "failed_at": 32768, "error": "x",
    ...     "runs": [{"N": 16384, "status": "ok", "tflops": 90.0, "time_ms": 1.0, "max_rel_err": 1e-3,
    ...     "temp_bytes": 2**31}, {"N": 32768, "status": "oom"}]}}}).splitlines()[-1])
    | naive | 16384 | 1.0 | 90 | 1.0e-03 | 2.00 | oom at N = 32768 |
    """
    c = longest["config"]
    head = ["implementation", "longest N", "ms at longest N", "TFLOP/s", "err (last rows)",
            "XLA scratch GiB", "stopped by"]
    lines = [f"B = 1, H = {c['heads']}, D = {c['head_dim']}, {c['dtype']}"
             f"{', causal' if c['causal'] else ''}; N doubles up to {longest['max_tried']}.", "",
             _row(head), _row(["---"] * len(head))]
    for name in [n for n in ORDER if n in longest["results"]]:
        s = longest["results"][name]
        ok = [r for r in s.get("runs", []) if r["status"] == "ok"]
        last = ok[-1] if ok else {}
        temp = last.get("temp_bytes")
        lines.append(_row([name, s.get("max_n") or "–", f"{last['time_ms']:.1f}" if ok else "–",
                           _cell(last) if ok else "–",
                           f"{last['max_rel_err']:.1e}" if ok else "–",
                           f"{temp / 2**30:.2f}" if temp is not None else "–", _stopped_by(s, longest)]))
    return "\n".join(lines)


def _stopped_by(s: dict, longest: dict) -> str:
    runs = s.get("runs", [])
    if s.get("failed_at"):
        return f"{runs[-1]['status']} at N = {s['failed_at']}"
    if s.get("max_n") == longest["max_tried"]:
        return "nothing (reached the largest N tried)"
    return s.get("status", "time budget") + (f": {s['error'][:60]}" if s.get("error") else "")


def _label(c: dict) -> str:
    return f"{c['dtype']} D={c['head_dim']} N={c['seq']}{' causal' if c['causal'] else ''}"


def render(res: dict, image: str | None = None) -> str:
    """Markdown for one run: heading, forward, longest-N and forward + backward tables."""
    dev, cand = res["device"], res["candidate"]
    stand_in = cand["used"] != cand["requested"]
    parts = [f"### {dev['kind']} — jax {res['jax']}, {res['date']}"
             + (" (quick smoke test: sizes tiny, timings meaningless)" if res.get("quick") else ""),
             f"Candidate: `{cand['used']}`"
             + (f" standing in for `{cand['requested']}` ({cand.get('note', 'unavailable')})." if stand_in
                else ".")]
    mixed = [_label(e["config"]) for e in res["forward"] + res["forward_backward"]
             if e["results"].get("candidate", {}).get("impl", cand["used"]) != cand["used"]]
    if mixed:
        parts.append(f"The candidate was not `{cand['used']}` in: {', '.join(mixed)} (see the JSON).")
    if "timing" not in res:  # runs before batched timing waited on every call
        parts.append("**Old timing method**: each call was waited on separately, so every time includes the "
                     "host round trip (~0.7 ms on the H200 VM); absolute TFLOP/s are low, ratios same-run.")
    if image:
        parts.append(f"![benchmark plot]({image})")
    if res["forward"]:
        parts += ["**Forward**, TFLOP/s (4·B·H·N²·D, halved when causal; B·N fixed); speedup = baseline "
                  "time ÷ candidate time; err = max|o − o_f32| ÷ max|o_f32|.", forward_table(res["forward"])]
    if res.get("longest"):
        parts += ["**Longest sequence**", longest_table(res["longest"])]
    if res["forward_backward"]:
        parts += ["**Forward + backward** (∇ of the sum of outputs), TFLOP/s at 3.5× forward FLOPs; "
                  "err is the largest over dQ, dK, dV.", forward_table(res["forward_backward"])]
    return "\n\n".join(parts)


def plot(res: dict, path: Path) -> None:
    """Bars of TFLOP/s per configuration and implementation, and the longest N each ran at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in (("forward", "forward"), ("forward_backward", "forward + backward"))
              if res[k]] + ([("longest", "longest N")] if res.get("longest") else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels, strict=True):
        (_longest_bars if key == "longest" else _tflops_bars)(ax, res[key])
        ax.set_title(f"{res['device']['kind']}: {title} (candidate = {res['candidate']['used']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tflops_bars(ax, entries: list) -> None:
    ran, _ = _columns(entries)
    width = 0.8 / max(1, len(ran))
    for i, name in enumerate(ran):
        ys = [e["results"].get(name, {}).get("tflops", 0) or 0 for e in entries]
        ax.bar([x + i * width for x in range(len(entries))], ys, width, label=name, color=COLOURS[name])
    labels = [f"{c['dtype']} D{c['head_dim']}\nN{c['seq']}{' c' if c['causal'] else ''}"
              for c in (e["config"] for e in entries)]
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(entries))], labels, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7, ncol=len(ran))


def _longest_bars(ax, longest: dict) -> None:
    names = [n for n in ORDER if longest["results"].get(n, {}).get("max_n")]
    ax.bar(names, [longest["results"][n]["max_n"] for n in names], color=[COLOURS[n] for n in names])
    ax.set_yscale("log", base=2)
    ax.set_ylabel("longest N that ran")


def transformer_summary(res: dict) -> str:
    """A markdown table of the final losses, for the README.

    >>> print(transformer_summary({"device": "cpu", "config": {"steps": 2, "d_model": 8, "layers": 1, "heads": 2,
    ...     "seq": 4, "batch": 2, "dtype": "f32"}, "diff": {},
    ...     "runs": {"reference": {"status": "ok", "losses": [4.0, 3.5], "held_out": [(1, 3.6)],
    ...     "seconds": 1.0, "forward": {"loss": 4.0, "max_abs_logit_diff": 0.0}}}}).splitlines()[-1])
    | reference | 0.0e+00 | ok | 3.500 | 3.600 | 1.0 |
    """
    c = res["config"]
    lines = [f"{res['device']}: {c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads, "
             f"context {c['seq']}, batch {c['batch']}, {c['dtype']} attention inputs, {c['steps']} Adam steps "
             f"(`{' '.join(res.get('argv', []))}`).", "",
             "| attention | forward under jit: max abs Δlogits vs reference | training | final train loss "
             "| final held-out loss | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in res["runs"].items():
        fwd = r.get("forward")
        cells = [name, f"{fwd['max_abs_logit_diff']:.1e}" if fwd else "–"]
        if r["status"] == "ok":
            cells += ["ok", f"{r['losses'][-1]:.3f}", f"{r['held_out'][-1][1]:.3f}", f"{r['seconds']:.1f}"]
        else:
            cells += [f"{r['status']}: {r['error'][:80].replace('|', '/')}", "–", "–", "–"]
        lines.append(_row(cells))
    lines += [f"\nLargest per-step loss difference, {k}: {v:.2e}." for k, v in res["diff"].items()]
    return "\n".join(lines)


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the part between ``name``'s markers replaced by ``body`` (appended if absent).

    >>> replace_section("a\\n<!-- r:begin -->\\nold\\n<!-- r:end -->\\nb", "r", "new")
    'a\\n<!-- r:begin -->\\nnew\\n<!-- r:end -->\\nb'
    """
    begin, end = BEGIN.format(name), END.format(name)
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        return text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def benchmark_section(results_dir: Path, relative_to: Path) -> str:
    """Every full run under ``results_dir`` rendered (quick runs only when there is no full one)."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        res = json.loads(path.read_text())
        if "forward" in res:
            png = path.with_suffix(".png")
            runs.append((res, os.path.relpath(png, relative_to) if png.exists() else None))
    chosen = [r for r in runs if not r[0].get("quick")] or runs
    if not chosen:
        return "No results yet: run the benchmark (see above)."
    return "\n\n".join(render(res, image) for res, image in chosen)


def transformer_section(results_dir: Path, relative_to: Path) -> str | None:
    """The transformer's loss table and curve (the quick run only when there is no full one)."""
    for stem in ("transformer", "transformer_quick"):
        path = results_dir / f"{stem}.json"
        if path.exists():
            png = path.with_suffix(".png")
            image = f"\n\n![loss curves]({os.path.relpath(png, relative_to)})" if png.exists() else ""
            return transformer_summary(json.loads(path.read_text())) + image
    return None


def write_readme(readme: Path, results_dir: Path) -> None:
    """Regenerate the README's results sections from the JSON files in ``results_dir``."""
    text = readme.read_text() if readme.exists() else ""
    text = replace_section(text, "benchmark-results", benchmark_section(results_dir, readme.parent))
    if (body := transformer_section(results_dir, readme.parent)) is not None:
        text = replace_section(text, "transformer-results", body)
    readme.write_text(text)
