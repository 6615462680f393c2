"""Pseudocode: the expanded loop program of a scheduled diagram (FAN §5).

A scheduled diagram's labels describe loops: tiled axes become ``parallel for`` loops over groups (one
group per core), axes every wire is weaved over (batch, heads) become parallel instances, the streamed
axis becomes a sequential ``for`` over chunks carrying the accumulators of the boxes that remove it.
Moves between levels are loads and stores; every other box is one on-chip operation, named from the
box (``S[q,x] = Σ_d Q[q,d]·K[x,d] · scale``; the online-softmax update with its running max, sum and
rescaling). Each line is annotated with the memory resident at each level in that column of the
diagram (sizes in sympy: ``g_q`` a group, ``s_x`` a chunk); the footer gives the largest column and
the transfers per level boundary (a colour change times the trip counts of its enclosing loops).

>>> import napkin_cat as nc
>>> from rewrites import tile, stream, level
>>> q, x, d = nc.axes("q x d")
>>> flash = level(nc.SMEM)(stream(x, 64)(tile(q, 128)(nc.library.attention(q, x, d))))
>>> text = pseudocode(flash)
>>> print(text.splitlines()[0])
# Q[q,d] ⊗ K[x,d] ⊗ V[x,d] → O[q,d]   with g_q = 128, s_x = 64
>>> print(text.splitlines()[-1])
transfers: HBM→SMEM d*q + 2*d*q*x/g_q; SMEM→HBM d*q; total 2*d*q + 2*d*q*x/g_q
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from napkin_cat.diagram import Array, Diagram, is_copy, is_structural
from napkin_cat.levels import HBM
from rewrites._rule import RewriteError
from rewrites._schedule import partitions

INDENT = "    "


@dataclass
class Value:
    """A value the program holds: its name, type, and whether it lives for the whole kernel."""

    name: str
    wire: Array
    boundary: bool = False  # a kernel input or output in HBM, resident throughout


@dataclass
class Line:
    depth: int
    text: str
    defs: list = field(default_factory=list)  # Values this line makes
    uses: list = field(default_factory=list)  # Values it reads
    loop: bool = False  # opens a loop
    inplace: bool = False  # the result may overwrite operands that die here (pointwise maps, finalize)


@dataclass
class Program:
    """The loop program being written; ``grid`` are the parallel instance axes, ``x`` the streamed one."""

    diagram: Diagram
    grid: tuple
    tiles: dict
    x: str | None
    lines: list = field(default_factory=list)
    taken: set = field(default_factory=set)

    def fresh(self, base: str) -> str:
        name, k = base, 2
        while name in self.taken:
            name, k = f"{base}{k}", k + 1
        self.taken.add(name)
        return name

    def emit(self, depth: int, text: str, defs=(), uses=(), loop: bool = False, inplace: bool = False):
        self.lines.append(Line(depth, text, list(defs), list(uses), loop, inplace))

    def size(self, wire: Array) -> sympy.Expr:
        """Elements of one block of ``wire``: grid axes count 1, a group ``g_a``, a chunk ``s_a``."""
        return sympy.Mul(*(_extent(a) for a in wire.axes if a.name not in self.grid))

    def ix(self, v: Value) -> str:
        """A value with its block's indices: ``S[q,x]`` (grid axes are implicit)."""
        names = [n for n in v.wire.names if n not in self.grid]
        return f"{v.name}[{','.join(names)}]" if names else v.name

    def state(self, base: str, wire: Array) -> Value:
        """A fresh accumulator state named after ``base``."""
        return Value(self.fresh(base), wire)

    def value(self, name: str, wire: Array) -> Value:
        """A temporary value named ``name`` inside one step (not tracked in memory)."""
        return Value(name, wire)

    def block(self, v: Value) -> str:
        """The slice of a wire one block reads: ``K[x₀:x₀+s_x, :]``; grid axes are fixed indices."""
        parts = []
        for a in v.wire.axes:
            if a.name in self.grid:
                parts.append(a.name)
            elif a.stream is not None:
                parts.append(f"{a.name}₀:{a.name}₀+s_{a.name}")
            elif a.group is not None:
                parts.append(f"{a.name}₀" if a.group == 1 else f"{a.name}₀:{a.name}₀+g_{a.name}")
            else:
                parts.append(":")
        return f"{v.name}[{', '.join(parts)}]"


def _extent(a) -> sympy.Expr:
    if a.stream is not None:
        return sympy.Symbol(f"s_{a.name}", positive=True, integer=True)
    if a.group is not None:
        return sympy.Integer(1) if a.group == 1 else sympy.Symbol(f"g_{a.name}", positive=True, integer=True)
    return a.size


def _grid(d: Diagram, tiles: dict, x: str | None) -> tuple:
    """Axes every input and output wire is weaved over and no box mixes: independent instances."""
    wires = [*d.dom.inside, *d.cod.inside]
    common = [n for n in wires[0].names if all(w.has(n) for w in wires)] if wires else []
    mixed = {n for b in d.boxes if not is_structural(b) for n in b.mixes}
    return tuple(n for n in common if n not in tiles and n != x and n not in mixed)


def _default_names(d: Diagram) -> tuple[list, list]:
    n_in, n_out = len(d.dom), len(d.cod)
    if any(b.normalises for b in d.boxes if not is_structural(b)) and n_in == 3:
        return ["Q", "K", "V"], ["O"] if n_out == 1 else [f"O{i + 1}" for i in range(n_out)]
    if n_in and all(len(w.axes) < len(d.dom.inside[0].axes) for w in d.dom.inside[1:]) and n_in <= 3:
        return ["X", "γ", "β"][:n_in], ["Y"] if n_out == 1 else [f"Y{i + 1}" for i in range(n_out)]
    letters = "ABCDEFGHIJKLMNOPRTUWZ"
    return list(letters[:n_in]), list(letters[n_in : n_in + n_out])


def _flow(d: Diagram):
    """Per layer, the value ids in and out (copies and swaps alias their inputs' ids)."""
    layers, fresh = [], [len(d.dom)]

    def step(i, box, ins):
        outs = list(range(fresh[0], fresh[0] + len(box.cod)))
        fresh[0] += len(box.cod)
        layers.append((box, ins, outs))
        return outs

    def moved(i, box, ins, outs):
        layers.append((box, ins, outs))

    stack = d.dataflow(list(range(len(d.dom))), step, structural=moved)
    return layers, stack


def pseudocode(d: Diagram, names: tuple[str, ...] | None = None) -> str:
    """The loop program of the scheduled diagram ``d``, with memory per column and transfers.

    ``names`` names the input wires (default: ``Q K V`` for attention, ``X γ β`` for a normalisation,
    else ``A B C …``); outputs and intermediates are named after the boxes producing them.

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> a, b, c = nc.axes("a b c")
    >>> print(pseudocode(stream(b, 32)(tile(a, 64)(nc.library.matmul(a, b, c)))))
    # A[a,b] ⊗ B[b,c] → C[a,c]   with g_a = 64, s_b = 32
    parallel for a₀ in range(0, a, g_a):    # a/g_a groups, one per core
        acc_C[a,c] = 0                      │ HBM c*g_a
        for b₀ in range(0, b, s_b):         │ HBM c*g_a
            acc_C[a,c] += Σ_b A[a,b]·B[b,c] │ HBM c*g_a
        C[a,c] = acc_C[a,c]
    memory (largest column): HBM c*g_a
    transfers: none (no level changes; recolour with rewrites._level)
    """
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise RewriteError("pseudocode", f"one streamed axis per kernel is supported, got {sorted(streams)}")
    x = next(iter(streams), None)
    prog = Program(d, _grid(d, tiles, x), tiles, x)
    layers, cod_ids = _flow(d)
    in_names, out_names = _default_names(d)
    if names is not None:
        if len(names) != len(d.dom):
            raise RewriteError("pseudocode", f"{len(names)} names for {len(d.dom)} inputs ({d.dom})")
        in_names = list(names)
    values: dict = {}
    for i, w in enumerate(d.dom.inside):
        values[i] = Value(prog.fresh(in_names[i]), w, boundary=True)
    output_of = _output_names(layers, cod_ids, out_names)
    _header(prog, values, [(out_names[i], w) for i, w in enumerate(d.cod.inside)])
    depth = _open_loops(prog)
    _body(prog, layers, values, output_of, depth)
    for i in cod_ids:
        values[i].boundary = values[i].wire.level == HBM
    return _render(prog)


def _output_names(layers, cod_ids, out_names) -> dict:
    """The value ids that become outputs (through stores), mapped to the output names."""
    source = {}
    for box, ins, outs in layers:
        if not is_structural(box) and box.transfers:
            source[outs[0]] = source.get(ins[0], ins[0])
    named = {}
    for k, i in enumerate(cod_ids):
        named.setdefault(i, out_names[k])
        named.setdefault(source.get(i, i), out_names[k])
    return named


def _header(prog: Program, values: dict, outs: list):
    sig = lambda name, w: f"{name}[{','.join(w.names)}]"  # noqa: E731
    dom = " ⊗ ".join(sig(v.name, v.wire) for v in values.values())
    cod = " ⊗ ".join(sig(n, w) for n, w in outs)
    sizes = [(f"g_{a}", g) for a, g in prog.tiles.items() if g != 1]
    sizes += [(f"s_{prog.x}", s) for s in partitions(prog.diagram)[1].values()]
    labels = [f"{n} = {v}" if isinstance(v, int) else f"{n} open" for n, v in sizes]
    prog.emit(0, f"# {dom} → {cod}" + (f"   with {', '.join(labels)}" if labels else ""))


def _open_loops(prog: Program) -> int:
    depth = 0
    if prog.grid:
        prog.emit(depth, f"parallel for {', '.join(prog.grid)}:", loop=True)
        depth += 1
    for a, g in prog.tiles.items():
        step = "1" if g == 1 else f"g_{a}"
        groups = a if g == 1 else f"{a}/g_{a}"
        prog.emit(depth, f"parallel for {a}₀ in range(0, {a}, {step}):    # {groups} groups, one per core", loop=True)
        depth += 1
    return depth


def _phase(prog: Program, box, carried: list, after: list) -> str:
    if prog.x is None:
        return "pre"
    if any(carried):
        return "loop" if any(w.has(prog.x) for w in box.cod.inside) else "acc"
    return "post" if any(after) else "pre"


def _body(prog: Program, layers, values: dict, output_of: dict, depth: int):
    x = prog.x
    carried = {i: v.wire.has(x) if x else False for i, v in values.items()}
    after = dict.fromkeys(values, False)
    pre, init, loop, final, post = [], [], [], [], []
    for box, ins, outs in layers:
        if is_structural(box):
            for i, o in zip(ins * len(box.cod) if is_copy(box) else ins[::-1], outs, strict=False):
                carried[o], after[o] = carried[i], after[i]
            continue
        phase = _phase(prog, box, [carried[i] for i in ins], [after[i] for i in ins])
        ins_v = [values[i] for i in ins]
        for o, w in zip(outs, box.cod.inside, strict=True):
            source = next((values[i].name for i in ins), "") if box.transfers else None
            values[o] = Value(source or prog.fresh(output_of.get(o) or box.symbol), w)
            if source:
                prog.taken.add(source)
            carried[o] = bool(x) and w.has(x) and phase != "acc"
            after[o] = phase in ("acc", "post")
        outs_v = [values[o] for o in outs]
        if phase == "acc":  # init before the stream loop, the accumulator's update in it, finalize after (FAN §3)
            for part, lines in zip((init, loop, final), box.accumulator(x).lines(prog, ins_v, outs_v), strict=True):
                part.extend(lines)
        else:
            {"pre": pre, "loop": loop, "post": post}[phase].extend(box.lines(prog, ins_v, outs_v))
    for entry in pre + init:
        prog.emit(depth, *entry)
    if x is not None:
        prog.emit(depth, f"for {x}₀ in range(0, {_x_range(prog)}, s_{x}):", loop=True)
        for entry in loop:
            prog.emit(depth + 1, *entry)
    for entry in final + post:
        prog.emit(depth, *entry)


def _x_range(prog: Program) -> str:
    return f"g_{prog.x}" if prog.x in prog.tiles else prog.x


def _render(prog: Program) -> str:
    lines = prog.lines
    last_use = _lifetimes(lines)
    live: list = []
    columns = []
    for i, line in enumerate(lines):
        floor = i + 1 if line.inplace else i
        live = [v for v in live if last_use.get(id(v), -1) >= floor] + [v for v in line.defs if not v.boundary]
        per_level: dict = {}
        for v in {id(v): v for v in live}.values():
            per_level[v.wire.level] = per_level.get(v.wire.level, 0) + prog.size(v.wire)
        columns.append(per_level)
    width = max((len(INDENT * ln.depth + ln.text) for ln in lines[1:] if not ln.loop), default=0) + 1
    out = [lines[0].text]
    for line, col in zip(lines[1:], columns[1:], strict=True):
        code = INDENT * line.depth + line.text
        memory = "; ".join(f"{lv} {sympy.sstr(sympy.expand(n))}" for lv, n in sorted(col.items()))
        out.append(f"{code:<{width}}│ {memory}".rstrip(" │") if memory else code)
    peak: dict = {}
    for col in columns:
        for lv, n in col.items():
            peak.setdefault(lv, []).append(sympy.expand(n))
    memory = "; ".join(f"{lv} {sympy.sstr(_largest(ns))}" for lv, ns in sorted(peak.items()))
    out.append(f"memory (largest column): {memory or 'none'}")
    out.append(_transfers(prog))
    return "\n".join(out)


def _largest(columns: list) -> sympy.Expr:
    """The largest of the column sizes; ``Max`` of those no other one provably dominates."""
    distinct = list(dict.fromkeys(columns))
    keep = [a for a in distinct if not any(b != a and sympy.factor(b - a).is_nonnegative for b in distinct)]
    return keep[0] if len(keep) == 1 else sympy.Max(*keep)


def _lifetimes(lines: list) -> dict:
    """Last line each value is needed: a value read inside a loop lives until that loop ends."""
    ends = []  # for each line, the index of the last line of the innermost loop it opens
    for i, line in enumerate(lines):
        j = i + 1
        while j < len(lines) and lines[j].depth > line.depth:
            j += 1
        ends.append(j - 1 if line.loop else i)
    last: dict = {}
    defined: dict = {}
    for i, line in enumerate(lines):
        for v in line.defs:
            defined.setdefault(id(v), i)
        for v in line.uses:
            end = i
            for k in range(defined.get(id(v), 0), i):
                if lines[k].loop and ends[k] >= i:
                    end = max(end, ends[k])
            last[id(v)] = max(last.get(id(v), -1), end)
    return last


def _transfers(prog: Program) -> str:
    """FAN's transfer cost: each colour change, times the trip counts of the loops around it."""
    d, x = prog.diagram, prog.x
    grid = sympy.Mul(*(next(a.size for w in d.dom.inside for a in w.axes if a.name == n) for n in prog.grid))
    groups = sympy.Mul(*(_axis(d, a).size / _extent(_axis(d, a)) for a in prog.tiles if a != x))
    totals: dict = {}
    for box in d.boxes:
        if is_structural(box) or not box.transfers:
            continue
        wire = box.dom.inside[0]
        trips = grid * groups
        if x is not None and wire.has(x):
            xa = wire.axis(x)
            trips *= (xa.group if xa.group is not None else xa.size) / _extent(xa)
            if xa.group is not None:
                trips *= xa.size / xa.group
        key = f"{wire.level}→{box.cod.inside[0].level}"
        totals[key] = totals.get(key, 0) + prog.size(wire) * trips
    if not totals:
        return "transfers: none (no level changes; recolour with rewrites._level)"
    total = sympy.expand(sum(totals.values()))
    parts = "; ".join(f"{k} {sympy.sstr(sympy.expand(v))}" for k, v in totals.items())
    return f"transfers: {parts}; total {sympy.sstr(total)}"


def _axis(d: Diagram, name: str):
    return next(a for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.name == name)
