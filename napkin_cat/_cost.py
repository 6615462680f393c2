"""The cost semantics: a functor from diagrams to cost records of sympy expressions (FAN §2–4).

A :class:`Cost` holds FLOPs, transcendentals, the values (and bytes) moved between memory levels, and the
peak values resident at each level. Records form a monoidal category: sequential composition adds the
work and transfers and takes the larger memory (memory is the largest column); parallel composition adds
everything. :func:`cost` sends each layer of a diagram to ``id(left) ⊗ F(box) ⊗ id(right)`` and composes
them, in one flat walk over the layers.

FAN's rules (the paper's §2–3: colours are levels, relabellings are tile and stream):

* a colour change (a :class:`~napkin_cat.generators.Move` box) moves the array's full size, times
  ``a/g_a`` for every tiled axis ``a`` of its kernel that does not index the array (an input not indexed
  by ``a`` is re-read by every group); streaming moves nothing more, since arrays not indexed by a
  streamed axis are hoisted out of the stream loop;
* a box whose wires sit in HBM is a kernel of its own: it reads its HBM inputs into ``onchip`` memory and
  writes its HBM outputs back, with the same re-read rule for its tiled axes (the unscheduled cost);
* memory at a level is the largest column: on per-SM levels a tiled axis counts ``g`` and a streamed axis
  ``s``; inside a stream loop the loop-invariant inputs and the accumulated outputs stay resident.
  Registers are private to a warpgroup, so memory at REG is one warpgroup's: a tile split over ``w``
  warpgroups (``rewrites.split``, ``a/g÷w``) counts ``g/w`` there, and :attr:`Cost.warpgroups` says how many
  such warpgroups fit an SM's register file (FAN §1.3 row 14).

Two global-memory figures, measured differently (the ncu counts in
``papers/flash_attention/results/cost_vs_hardware_NVIDIA_H100_80GB_HBM3.md``):

* **GMEM→SMEM bytes** (:attr:`Cost.gmem_bytes`; ``hbm_bytes`` is the same figure under its old name): what
  the SMs read from and write to global memory, re-reads included. Every block of a kernel's grid reads
  its blocks of the inputs, so an input not indexed by a grid axis (a tiled axis ``a``, factor ``a/g``,
  or a batch axis, factor its size: K/V of grouped-query attention) is re-read by every block along it.
  A causal mask between the tiled and the streamed axis skips the chunks past the diagonal: the loop's
  transfers and work take the visited fraction ``(n + max(g, s)) / 2n`` (exact for a square mask and
  ``g``, ``s`` powers of two). This is ncu's ``l1tex__m_xbar2l1tex_read_bytes`` plus the writes.
* **DRAM bytes** (:attr:`Cost.dram_bytes`): what reaches HBM itself, after the L2 cache. The grid runs
  its first tiled axis fastest, then the others, then the batch axes (``lowering._plan``; Pallas' Triton
  lowering maps grid dimension 0 to CUDA's ``blockIdx.x``, which the hardware dispatches fastest), and a
  wave of ``SMs × blocks_per_sm`` consecutive blocks touches, per grid axis indexing the array,
  ``min(n_j, ⌈C/σ_j⌉)`` of its ``n_j`` slabs (``σ_j`` blocks per step of axis ``j``). The blocks of a wave
  reading one slab share its trip from DRAM; a slab that later waves read again is still in L2 with the
  probability :func:`l2_survival` gives for the wave's working set against one L2 partition
  (:attr:`~napkin_cat.hardware.Hardware.l2_shared_capacity`): 1 when it fits, so each input is read once.

>>> import napkin_cat as nc
>>> from napkin_cat.hardware import H100
>>> q, x, d = nc.axes("q x d")
>>> naive = cost(nc.library.attention(q, x, d), H100)
>>> naive.transfers[SMEM]   # FAN's row 7 (papers/flash_attention_on_a_napkin/table.md): S and P written and read once
2*d*q + 2*d*x + 4*q*x
>>> naive.flops
4*d*q*x + 5*q*x

FlashAttention on a 50 MB L2: K and V of the heads in flight fit, so DRAM sees each input once
(``papers/flash_attention/results/cost_vs_hardware_NVIDIA_H100_80GB_HBM3.md``: ncu reads 201,646,848 B from DRAM
and 8,657,043,456 B into shared memory):

>>> from rewrites import derive, tile, stream, level
>>> b, h = nc.axes("b h")
>>> mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16")
>>> fa = cost(derive(mha, tile(q, 128), stream(x, 64), level(SMEM), verify=False).diagram, H100)
>>> n = fa.subs(b=2, h=16, q=8192, x=8192, d=128)
>>> int(n.gmem_bytes - n.gmem_write_bytes), int(n.dram_bytes - n.gmem_write_bytes)
(8657043456, 201326592)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import sympy

from napkin_cat.diagram import Array, Diagram, is_structural
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.errors import CostError, NapkinError
from napkin_cat.hardware import Hardware, lookup
from napkin_cat.levels import HBM, L2, REG, SMEM, Level
from napkin_cat.levels import level as as_level

Expr = sympy.Expr
ZERO = sympy.Integer(0)


def _add(*maps: Mapping) -> dict:
    out: dict = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, ZERO) + v
    return out


def _max(*maps: Mapping) -> dict:
    keys = dict.fromkeys(k for m in maps for k in m)
    return {k: sympy.Max(*{m[k] for m in maps if k in m}) for k in keys}


@dataclass(frozen=True)
class Cost:
    """A cost record on ``hardware``: sympy expressions in the axis and partition sizes.

    ``moves`` maps ``(outer, inner)`` level pairs to values moved between them (both directions);
    ``memory`` maps a level to the peak values resident there. ``tensor_flops`` are the contraction FLOPs
    by the narrowest operand dtype (they run on tensor cores); the remaining FLOPs run on CUDA cores.

    >>> from napkin_cat.hardware import H100
    >>> c = Cost(H100, flops=sympy.Integer(10), memory={SMEM: sympy.Integer(3)})
    >>> (c >> c).flops, (c >> c).memory[SMEM], (c @ c).memory[SMEM]
    (20, 3, 6)
    """

    hardware: Hardware | None
    flops: Expr = ZERO
    transcendentals: Expr = ZERO
    tensor_flops: Mapping[Dtype, Expr] = field(default_factory=dict)
    moves: Mapping[tuple[Level, Level], Expr] = field(default_factory=dict)
    move_bytes: Mapping[tuple[Level, Level], Expr] = field(default_factory=dict)
    memory: Mapping[Level, Expr] = field(default_factory=dict)
    memory_bytes: Mapping[Level, Expr] = field(default_factory=dict)
    dram_bytes: Expr = ZERO
    gmem_write_bytes: Expr = ZERO

    # --- the category ----------------------------------------------------------------------------
    @classmethod
    def sequence(cls, hardware: Hardware | None, records: Iterable[Cost]) -> Cost:
        """``r₁ >> r₂ >> …`` in one step: work and transfers add, memory is the largest column."""
        records = list(records)
        return cls(
            hardware,
            flops=sympy.Add(*(r.flops for r in records)),
            transcendentals=sympy.Add(*(r.transcendentals for r in records)),
            tensor_flops=_add(*(r.tensor_flops for r in records)),
            moves=_add(*(r.moves for r in records)),
            move_bytes=_add(*(r.move_bytes for r in records)),
            memory=_max(*(r.memory for r in records)),
            memory_bytes=_max(*(r.memory_bytes for r in records)),
            dram_bytes=sympy.Add(*(r.dram_bytes for r in records)),
            gmem_write_bytes=sympy.Add(*(r.gmem_write_bytes for r in records)),
        )

    def then(self, other: Cost) -> Cost:
        """Sequential composition (the cost of ``f >> g``)."""
        return Cost.sequence(self.hardware, (self, other))

    def tensor(self, other: Cost) -> Cost:
        """Parallel composition (the cost of ``f @ g``): both run, both are resident at once."""
        return replace(
            Cost.sequence(self.hardware, (self, other)),
            memory=_add(self.memory, other.memory),
            memory_bytes=_add(self.memory_bytes, other.memory_bytes),
        )

    __rshift__, __matmul__ = then, tensor

    # --- derived figures -------------------------------------------------------------------------
    @property
    def transfers(self) -> dict[Level, Expr]:
        """Values moved between each level and the levels outside it, keyed by the inner level."""
        return _add(*({inner: v} for (_, inner), v in self.moves.items()))

    @property
    def bytes(self) -> dict[Level, Expr]:
        """Bytes moved between each level and the levels outside it, keyed by the inner level."""
        return _add(*({inner: v} for (_, inner), v in self.move_bytes.items()))

    @property
    def hbm_transfers(self) -> Expr:
        """Values read from or written to HBM."""
        return sympy.Add(*(v for (outer, _), v in self.moves.items() if outer == HBM))

    @property
    def gmem_bytes(self) -> Expr:
        """Bytes the SMs read from or write to global memory, re-reads included (before the L2 cache).

        ``gmem_bytes - gmem_write_bytes`` is what ncu calls ``l1tex__m_xbar2l1tex_read_bytes``; DRAM
        traffic after L2 is :attr:`dram_bytes`.
        """
        return sympy.Add(*(v for (outer, _), v in self.move_bytes.items() if outer == HBM))

    @property
    def hbm_bytes(self) -> Expr:
        """The old name of :attr:`gmem_bytes`: global-memory traffic as the SMs see it, *not* DRAM traffic."""
        return self.gmem_bytes

    @property
    def intensity(self) -> Expr:
        """Arithmetic intensity: FLOPs per byte of HBM traffic."""
        return self.flops / self.hbm_bytes

    @property
    def link_bytes(self) -> dict[Level, Expr]:
        """Bytes crossing each of the hardware's links, keyed by the link's inner level.

        A move from HBM to SMEM also crosses the HBM → L2 link: both share its bandwidth.
        """
        out: dict = {}
        for (outer, inner), b in self.move_bytes.items():
            for m in self._hardware("link bytes").memories:
                if outer < m.level <= inner:
                    out[m.level] = out.get(m.level, ZERO) + b
        return out

    def _resource_times(self, kernel: bool) -> dict[str, Expr]:
        hw = self._hardware("times")
        rates = dict(hw.flop_rates)

        def rate(what: str, datasheet: float) -> sympy.Float:
            ceiling = hw.ceiling(what) if kernel else None
            return sympy.Float(datasheet if ceiling is None else ceiling)

        def tensor_rate(t: Dtype) -> sympy.Float:
            # Pallas' Triton lowering runs an f32 dot at default precision as TF32 on the tensor cores
            name = "tf32" if kernel and t == f32 and "tf32" in rates else t.name
            return rate(name, rates[name] if name == "tf32" else hw.flops(t))

        tensor = sympy.Add(*(f / tensor_rate(t) for t, f in self.tensor_flops.items()))
        vector = (self.flops - sympy.Add(*self.tensor_flops.values())) / sympy.Float(hw.flops(f32))
        sfu = self.transcendentals / sympy.Float(hw.exp_per_clk * hw.sms * hw.clock)
        out = {"tensor": tensor, "vector": vector, "sfu": sfu}
        for level, b in self.link_bytes.items():
            if level == L2:
                out[f"→{level.name}"] = self.dram_bytes / rate("dram", hw.bandwidth(level))
            else:
                out[f"→{level.name}"] = b / sympy.Float(hw.bandwidth(level))
        return out

    @property
    def times(self) -> dict[str, Expr]:
        """Seconds each resource needs at its datasheet peak: tensor cores, CUDA cores, SFU, and each link.

        The link into L2 carries the DRAM bytes (:attr:`dram_bytes`); the links further in carry the
        bytes moved into them (``→SMEM``: the GMEM→SMEM bytes, at L2's bandwidth into the SMs).
        """
        return self._resource_times(kernel=False)

    @property
    def kernel_times(self) -> dict[str, Expr]:
        """:attr:`times` at the rates the lowered kernels run at: the hardware's measured ceilings where it has
        them (:meth:`Hardware.ceiling`: the tensor cores' large-matmul rate, DRAM's copy bandwidth), f32
        contractions on the tensor cores as TF32 (Pallas' Triton default precision), the datasheet elsewhere
        (SFU: FAN row 15).

        >>> import napkin_cat as nc
        >>> from napkin_cat.hardware import H100
        >>> c = Cost(H100, flops=sympy.Integer(733 * 10**12), tensor_flops={nc.bf16: sympy.Integer(733 * 10**12)})
        >>> float(c.kernel_times["tensor"]), round(float(c.times["tensor"]), 3)
        (1.0, 0.741)
        >>> tf32 = Cost(H100, flops=sympy.Integer(10**12), tensor_flops={nc.f32: sympy.Integer(10**12)})
        >>> round(float(tf32.kernel_times["tensor"]) * 1e3, 2), round(float(tf32.times["tensor"]) * 1e3, 2)
        (2.02, 14.93)
        """
        return self._resource_times(kernel=True)

    @property
    def time(self) -> Expr:
        """The roofline lower bound in seconds: the busiest resource's time at datasheet peaks (everything overlaps)."""
        return sympy.Max(*self.times.values())

    @property
    def time_serial(self) -> Expr:
        """The predicted time in seconds: the slowest of the levels' transfer times and the compute, where the
        compute is tensor-core + CUDA-core + exp-unit time in series (the lowered kernels do not overlap their
        softmax with their matmuls), each at :attr:`kernel_times`' rates.

        >>> import napkin_cat as nc
        >>> from napkin_cat.hardware import A100, H100
        >>> c = Cost(H100, flops=sympy.Integer(733 * 10**12), tensor_flops={nc.bf16: sympy.Integer(733 * 10**12)})
        >>> float(c.time_serial), round(float(c.time), 3), round(float(replace(c, hardware=A100).time_serial), 3)
        (1.0, 0.741, 2.349)
        """
        return self.bound(self.kernel_times)

    @staticmethod
    def bound(times: Mapping[str, Expr]) -> Expr:
        """The serial time of per-resource ``times``: the slowest link, or the compute units' sum.

        >>> Cost.bound({"tensor": 1, "vector": 2, "sfu": 3, "→SMEM": 5})
        6
        """
        links = [v for k, v in times.items() if k.startswith("→")]
        return sympy.Max(*links, times["tensor"] + times["vector"] + times["sfu"])

    def _hardware(self, what: str) -> Hardware:
        if self.hardware is None:
            raise CostError(f"{what} need a hardware model: cost(diagram, hardware)")
        return self.hardware

    # --- numbers ---------------------------------------------------------------------------------
    def subs(self, **sizes) -> Cost:
        """The record with sizes bound by symbol name (``q=4096, g_q=128``) to positive integers or sympy
        expressions; anything else (a string, a float, a size ≤ 0) is a :class:`CostError`.

        >>> import napkin_cat as nc
        >>> from napkin_cat.hardware import H100
        >>> m = cost(nc.library.matmul(*nc.axes("a b c"), dtype=nc.bf16), H100)
        >>> m.subs(a=1024, b=1024, c=1024).hbm_bytes
        6291456
        >>> m.subs(a="abc")
        Traceback (most recent call last):
        ...
        napkin_cat.errors.CostError: subs: size a = 'abc' (str) must be a positive integer or a sympy expression
        """
        for name, n in sizes.items():
            _check_size("subs", name, n, symbolic=True)

        def sub(e):
            bind = {s: sizes[s.name] for s in e.free_symbols if s.name in sizes}
            return e.xreplace({s: sympy.sympify(v) for s, v in bind.items()}) if bind else e

        def sub_map(m):
            return {k: sub(v) for k, v in m.items()}

        return Cost(
            self.hardware,
            flops=sub(self.flops),
            transcendentals=sub(self.transcendentals),
            tensor_flops=sub_map(self.tensor_flops),
            moves=sub_map(self.moves),
            move_bytes=sub_map(self.move_bytes),
            memory=sub_map(self.memory),
            memory_bytes=sub_map(self.memory_bytes),
            dram_bytes=sub(self.dram_bytes),
            gmem_write_bytes=sub(self.gmem_write_bytes),
        )

    def number(self, what: str, **sizes) -> float:
        """A figure (an attribute name: ``"time"``, ``"flops"``, ``"hbm_bytes"``…) as a float.

        >>> import napkin_cat as nc
        >>> from napkin_cat.hardware import H100
        >>> m = cost(nc.library.matmul(*nc.axes("a b c"), dtype=nc.bf16), H100)
        >>> m.number("time", a=8192, b=8192)
        Traceback (most recent call last):
        ...
        napkin_cat.errors.CostError: time on H100 needs sizes for c (bound: a, b)
        >>> m.number("time", a=8192, b=8192, c=-5)
        Traceback (most recent call last):
        ...
        napkin_cat.errors.CostError: time: size c = -5 must be a positive integer
        """
        if what not in FIGURES:
            raise CostError(f"number: {what!r} is not a figure of a cost record; figures: {', '.join(FIGURES)}")
        for name, n in sizes.items():  # size symbols are positive integers: a negative size gives negative time
            _check_size(what, name, n, symbolic=False)
        value = getattr(self.subs(**sizes), what)
        if not value.is_number:
            missing = ", ".join(sorted(s.name for s in value.free_symbols))
            on = f" on {self.hardware.name}" if self.hardware is not None else ""
            raise CostError(f"{what}{on} needs sizes for {missing} (bound: {', '.join(sizes)})")
        if value < 0:  # an axis whose size is positive only for some values (n - 5) at values where it is not
            raise CostError(
                f"{what} = {value} at {', '.join(f'{k}={v}' for k, v in sizes.items())} is negative: some axis size "
                "is not positive at these sizes; pass sizes at which every axis is"
            )
        return float(value)

    @property
    def warpgroups(self) -> Expr:
        """How many warpgroups holding this record's registers (one warpgroup's: a split tile counts its part)
        fit an SM's register file, FAN §1.3 row 14's N_max; :class:`CostError` without registers.

        >>> import napkin_cat as nc
        >>> from napkin_cat.hardware import H100
        >>> from rewrites import derive, tile, split, stream, level
        >>> q, x, d = nc.axes("q x d", d=128)
        >>> attn = nc.library.attention(q, x, d, dtype="bf16")
        >>> [cost(derive(attn, tile(q, 256), *w, stream(x, 64), level(REG), verify=False).diagram, H100).warpgroups
        ...  for w in ((), (split(q, 2),))]
        [1, 2]
        """
        hw = self._hardware("warpgroups per SM")
        need = self.memory_bytes.get(REG, ZERO)
        if need == 0:
            raise CostError("warpgroups per SM: the record holds no registers (recolour with rewrites.level(REG))")
        return sympy.floor(hw.capacity(REG) / need)

    def check(self, **sizes) -> Cost:
        """Raise a :class:`CostError` if the peak memory of a level exceeds the hardware's capacity.

        Per-SM levels are checked against one block's share (SMEM: the per-block limit). Levels whose
        memory stays symbolic after binding ``sizes`` are not checked.
        """
        bound = self.subs(**sizes)
        hw = self._hardware("memory checks")
        for level, needed in bound.memory_bytes.items():
            limit = _capacity(hw, level)
            if needed.is_number and needed > limit:
                raise CostError(
                    f"memory at {level.name}: {int(needed)} B needed ({self.memory[level]} values) exceeds "
                    f"{hw.name}'s {limit} B"
                )
        return bound

    def __str__(self) -> str:
        parts = [f"flops {self.flops}", f"transcendentals {self.transcendentals}"]
        parts += [f"transfers {inner.name} {v}" for inner, v in self.transfers.items()]
        parts += [f"memory {level.name} {v}" for level, v in self.memory.items()]
        return "; ".join(parts)


#: the figures :meth:`Cost.number` gives (attributes of a record that are one expression)
FIGURES = (
    "time", "time_serial", "flops", "transcendentals", "gmem_bytes", "hbm_bytes", "dram_bytes", "gmem_write_bytes",
    "hbm_transfers", "intensity", "warpgroups",
)  # fmt: skip


def _check_size(what: str, name: str, n, *, symbolic: bool) -> None:
    """Refuse a size bound to ``name`` that is not a positive integer (or, where ``symbolic``, a sympy expression)."""
    if symbolic and isinstance(n, sympy.Expr) and not n.is_number:
        return
    kind = " or a sympy expression" if symbolic else ""
    if isinstance(n, str):  # sympify would read 'abc' as a new symbol
        raise CostError(f"{what}: size {name} = {n!r} (str) must be a positive integer{kind}")
    try:
        v = sympy.sympify(n)
    except (sympy.SympifyError, TypeError):
        v = None
    if isinstance(n, bool) or v is None or not (v.is_integer and v.is_positive):
        raise CostError(f"{what}: size {name} = {n!r} must be a positive integer{kind}")


def _capacity(hw: Hardware, level: Level) -> int:
    return hw.smem_per_block if level == SMEM else hw.capacity(level)


# --- the functor: a flat walk over the layers ------------------------------------------------------


def _groups(array: Array, grid: Mapping[str, Expr]) -> Expr:
    """FAN's re-read factor: the blocks along every grid axis not indexing ``array`` (``a/g`` when tiled)."""
    return sympy.Mul(*(n for name, n in grid.items() if not array.has(name)))


@dataclass
class _Kernel:
    """One kernel's schedule as the cost functor needs it."""

    tiled: dict  # name -> Axis, in grid order
    streamed: dict  # name -> Axis
    resident: set = field(default_factory=set)
    batch: dict = field(default_factory=dict)  # name -> size, in the wires' order (the last runs fastest)
    visited: Expr = sympy.Integer(1)  # the fraction of the stream loop a causal mask lets run
    rereads: list = field(default_factory=list)  # (array, its re-read factor)

    @property
    def grid(self) -> dict:
        """Blocks along each grid axis, fastest first (``lowering._plan``: tiles, then batch reversed).

        An untiled kernel keeps its batch axes whole in one block (FAN's convention for the unscheduled axes).
        """
        if not self.tiled:
            return {}
        return {**{a: t.groups for a, t in self.tiled.items()}, **dict(reversed(self.batch.items()))}

    def touched(self, array: Array, concurrent: Expr) -> Expr:
        """Slabs of ``array`` that ``concurrent`` consecutive blocks read: ``min(n_j, ⌈C/σ_j⌉)`` per axis."""
        out, stride = sympy.Integer(1), sympy.Integer(1)
        for a, n in self.grid.items():
            if array.has(a):
                out *= sympy.Min(n, sympy.ceiling(concurrent / stride))
            stride *= n
        return out

    def slab(self, array: Array) -> Expr:
        """Bytes of one block's slab of ``array``."""
        return array.size * array.dtype.bytes / sympy.Mul(*(n for a, n in self.grid.items() if array.has(a)))

    def working_set(self, concurrent: Expr) -> Expr:
        """Bytes of the re-read arrays that ``concurrent`` consecutive blocks of the grid touch."""
        return sympy.Add(*(self.touched(a, concurrent) * self.slab(a) for a, _ in self.rereads))


class _Walk:
    """Wires of a diagram named by integer ids, with kernels as connected on-chip regions."""

    def __init__(self, d: Diagram):
        self.arrays: list[Array] = []
        self.parent: list[int] = []
        self.layers = []
        stack = [self._new(w) for w in d.dom.inside]

        def layer(i, box, ins, outs=None):  # copies alias their input; a discard ends it
            if outs is None:
                outs = [self._new(w) for w in box.cod.inside]
                self._join([j for j in ins + outs if self.arrays[j].level > HBM])
            left = len(d.inside[i][0])
            self.layers.append((stack[:left] + stack[left + len(ins) :], box, ins, outs))
            stack[left : left + len(ins)] = outs
            return outs

        d.dataflow(list(stack), layer, structural=layer)

    def _new(self, array: Array) -> int:
        self.arrays.append(array)
        self.parent.append(len(self.parent))
        return len(self.arrays) - 1

    def root(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _join(self, ids: list[int]):
        for i in ids[1:]:
            self.parent[self.root(i)] = self.root(ids[0])

    def labelled(self, ids: Iterable[int], label: str) -> dict:
        """Axes carrying ``label`` ("group" or "stream") on the given wires, by name."""
        return {a.name: a for i in ids for a in self.arrays[i].axes if getattr(a, label) is not None}


def cost(d: Diagram, hardware: Hardware | str | None = None, *, onchip: Level = SMEM, blocks_per_sm: int = 1) -> Cost:
    """The cost of ``d`` on ``hardware``; boxes on HBM wires run as kernels through ``onchip`` memory.

    Without ``hardware`` the record has work, transfers and memory but no times, levels deeper
    than L2 count as per-SM, and DRAM bytes equal GMEM bytes (no L2 to reuse). With it, every level
    the diagram uses must exist on the hardware, and a numeric peak memory over the hardware's capacity
    raises :class:`CostError`. ``hardware`` may be a model's name (``"H100"``, see
    :data:`napkin_cat.hardware.HARDWARE`). ``blocks_per_sm`` is how many blocks of a kernel each SM
    runs at once (the L2 working set's width); the lowered attention kernels run one (8 warps at
    Triton's register use fill an SM's 64K registers).

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H100
    >>> a, b, c = nc.axes("a b c")
    >>> tiled = nc.library.matmul(a, b, c).map_arrays(
    ...     lambda w: w.with_(axes=[{"a": a.tiled("g_a"), "b": b.streamed("s_b"), "c": c.tiled("g_c")}[x.name]
    ...                              for x in w.axes]))
    >>> t = cost(tiled, H100)
    >>> sympy.expand(t.transfers[SMEM])            # row 1 of papers/flash_attention_on_a_napkin/table.md
    a*b*c/g_c + a*b*c/g_a + a*c
    >>> t.memory[SMEM]
    g_a*g_c + g_a*s_b + g_c*s_b
    """
    onchip = _arguments(d, onchip, blocks_per_sm)
    walk = _Walk(d)
    if hardware is not None:
        hardware = lookup(hardware)
        for level in sorted({w.level for w in walk.arrays} | {onchip}):
            hardware.memory(level)
    kernels = _kernels(walk)
    records = [_layer(walk, kernels, hardware, onchip, layer) for layer in walk.layers]
    if not records:  # an identity: only its wires' memory
        records = [_column(walk, hardware, range(len(walk.arrays)), ())]
    total = Cost.sequence(hardware, records)
    total = replace(total, dram_bytes=total.dram_bytes + _dram_rereads(kernels, hardware, blocks_per_sm))
    if hardware is not None:
        total.check()
    return total


def _arguments(d, onchip, blocks_per_sm) -> Level:
    """Refuse :func:`cost`'s arguments that are not what they should be, naming the argument and the fix;
    ``onchip`` as a :class:`Level`."""
    if not isinstance(d, Diagram):
        raise CostError(
            f"cost: expected a napkin_cat Diagram, got {type(d).__name__} {_short(d)}; pass a diagram "
            "(nc.library.attention(q, x, d)) or, for a derivation, derivation.cost(hardware)"
        )
    try:
        onchip = as_level(onchip)
    except NapkinError as e:
        raise CostError(f"cost: onchip={onchip!r}: {e}; pass onchip=nc.SMEM or nc.REG") from None
    if onchip == HBM:
        raise CostError("cost: onchip=HBM: a kernel reads its HBM inputs into on-chip memory; pass nc.SMEM or nc.REG")
    if isinstance(blocks_per_sm, bool) or not isinstance(blocks_per_sm, int) or blocks_per_sm < 1:
        raise CostError(f"cost: blocks_per_sm must be a positive integer, got {blocks_per_sm!r}")
    return onchip


def _short(x, width: int = 60) -> str:
    """``repr(x)``, cut to ``width`` characters for an error message."""
    text = repr(x)
    return text if len(text) <= width else text[: width - 1] + "…"


def l2_survival(ratio) -> Expr:
    """The fraction of a re-read slab still in L2 when the next wave of blocks reads it again.

    ``ratio`` is the wave's working set over the L2 capacity it can use. Between two reads of a line, the
    other lines of the working set are read once each; L2's replacement policy is undocumented, so take
    each miss to evict a uniformly random line (random replacement: strict LRU would keep nothing of a
    cyclic working set over capacity, where the matmul at 4096³ on an H100 keeps part of it). A line
    survives the ``ratio·(1 − h)`` capacities' worth of misses between its reads with probability
    ``h = exp(−ratio·(1 − h))``; the root below 1 is ``h = −W₀(−ratio·e^(−ratio))/ratio`` (Lambert's W,
    principal branch), and ``h = 1`` when the working set fits (``ratio ≤ 1``).

    >>> l2_survival(sympy.Rational(1, 2)), round(float(l2_survival(2)), 4), round(float(l2_survival(6)), 4)
    (1, 0.2032, 0.0025)
    """
    r = sympy.sympify(ratio)
    root = -sympy.LambertW(-r * sympy.exp(-r)) / r
    return sympy.Piecewise((sympy.Integer(1), r <= 1), (root, True))


def _dram_rereads(kernels: dict, hw: Hardware | None, blocks_per_sm: int) -> Expr:
    """DRAM bytes of the re-read inputs, wave by wave through L2.

    A wave is the ``SMs × blocks_per_sm`` consecutive blocks that run at once; the blocks of a wave that
    read the same slab share one trip from DRAM, so a slab re-read ``n`` times is fetched by ``n/share``
    waves (``share = min(n, C/touched)``, :meth:`_Kernel.touched`). The first fetch is compulsory; each
    later one hits L2 with the probability :func:`l2_survival` gives for the wave's working set against
    :attr:`Hardware.l2_shared_capacity` (a slab read by blocks on every SM is cached in both L2 partitions).
    """
    out = ZERO
    for k in kernels.values():
        if not k.rereads:
            continue
        if hw is None or not any(m.level == L2 for m in hw.memories):
            out += sympy.Add(*(a.size * a.dtype.bytes * n for a, n in k.rereads))
            continue
        c = sympy.Integer(hw.sms * blocks_per_sm)
        miss = 1 - l2_survival(k.working_set(c) / hw.l2_shared_capacity)
        for a, n in k.rereads:
            waves = n / sympy.Min(n, sympy.Max(1, c / k.touched(a, c)))
            out += a.size * a.dtype.bytes * (1 + (waves - 1) * miss)
    return out


def _kernels(walk: _Walk) -> dict:
    """Per kernel (root id): its tiled, streamed and batch axes, the wires resident in its stream loop, and
    the fraction of the loop a causal mask visits."""
    members: dict[int, list[int]] = {}
    for i, a in enumerate(walk.arrays):
        if a.level > HBM:
            members.setdefault(walk.root(i), []).append(i)
    kernels = {r: _Kernel(walk.labelled(ids, "group"), walk.labelled(ids, "stream")) for r, ids in members.items()}
    mixed: dict[int, set] = {r: set() for r in kernels}
    for _, box, ins, outs in walk.layers:
        wires = [i for i in ins + outs if walk.arrays[i].level > HBM]
        if not wires:
            continue
        k = kernels[walk.root(wires[0])]
        if not is_structural(box):
            mixed[walk.root(wires[0])] |= set(getattr(box, "mixes", ()))
            diagonal = set(box.diagonal() or ())
            for t, x in ((t, x) for t in k.tiled for x in k.streamed):
                if diagonal == {t, x}:  # blocks past the diagonal are skipped (lowering._blocks)
                    n, g, s = k.tiled[t].size, k.tiled[t].group, k.streamed[x].stream
                    k.visited = (n + sympy.Max(g, s)) / (2 * n)
        if any(walk.arrays[i].has(s) for i in wires for s in k.streamed):  # a box inside the stream loop
            k.resident |= {i for i in wires if not any(walk.arrays[i].has(s) for s in k.streamed)}
    for r, ids in members.items():
        k = kernels[r]
        for i in ids:
            for a in walk.arrays[i].axes:
                if a.name not in k.tiled and a.name not in k.streamed and a.name not in mixed[r]:
                    k.batch.setdefault(a.name, a.size)
    return kernels


def _footprint(hw: Hardware | None, array: Array) -> Expr:
    """Values of ``array`` resident at its level: one group's or chunk's share on per-SM levels, one
    warpgroup's part of a split group in registers."""
    per_sm = hw.memory(array.level).per_sm if hw is not None else array.level > L2
    if array.level == REG:
        return array.local_size / sympy.Mul(*(a.parts for a in array.axes))
    return array.local_size if per_sm else array.size


def _column(walk: _Walk, hw: Hardware | None, ids: Iterable[int], extra: Iterable[tuple[Level, Expr, Expr]]) -> Cost:
    memory: dict = {}
    memory_bytes: dict = {}
    for i in dict.fromkeys(ids):
        a = walk.arrays[i]
        n = _footprint(hw, a)
        memory[a.level] = memory.get(a.level, ZERO) + n
        memory_bytes[a.level] = memory_bytes.get(a.level, ZERO) + n * a.dtype.bytes
    for level, n, b in extra:
        memory[level] = memory.get(level, ZERO) + n
        memory_bytes[level] = memory_bytes.get(level, ZERO) + b
    return Cost(hw, memory=memory, memory_bytes=memory_bytes)


def _rescale(box, k: _Kernel) -> tuple[Expr, Expr]:
    """FLOPs and exponentials a streamed normalising box spends rescaling its state, over every chunk.

    The online softmax (FlashAttention-2's step, :class:`~napkin_cat.generators.OnlineSoftmax`) rescales
    its accumulated outputs by ``δ = exp(m − m')`` at every chunk: one multiply per output value, and per
    row of the scores the new max, ``δ``'s subtraction, the sum's rescale and add (4 FLOPs) and ``δ`` itself
    (one exponential). The unstreamed box does none of it, so it grows as the chunk shrinks.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream, level
    >>> q, x, d = nc.axes("q x d")
    >>> fa = derive(nc.library.attention(q, x, d), tile(q, 64), stream(x), level(SMEM), verify=False)
    >>> sympy.factor(cost(fa.diagram).flops - cost(nc.library.attention(q, x, d)).flops)
    q*x*(d + 4)/s_x
    """
    if not getattr(box, "normalises", False) or not box.dom.inside:
        return ZERO, ZERO
    scores = box.dom.inside[0]
    for name, axis in k.streamed.items():
        if scores.has(name) and box.accumulator(name) is not None:
            chunks = axis.size / axis.stream
            rows = scores.size / axis.size
            outputs = sympy.Add(*(w.size for w in box.cod.inside))
            return chunks * (outputs + 4 * rows), chunks * rows
    return ZERO, ZERO


def _layer(walk: _Walk, kernels: dict, hw: Hardware | None, onchip: Level, layer) -> Cost:
    """``id(left) ⊗ F(box) ⊗ id(right)``: the box's work and transfers, the column's memory."""
    whiskers, box, ins, outs = layer
    column = whiskers + ins + outs
    wires = [i for i in ins + outs if walk.arrays[i].level > HBM]
    visited = sympy.Integer(1)
    rescale = (ZERO, ZERO)
    if wires:
        k = kernels[walk.root(wires[0])]
        if any(walk.arrays[i].has(s) for i in wires for s in k.streamed):
            column = column + sorted(k.resident)
            visited = k.visited
            if not is_structural(box):
                rescale = _rescale(box, k)
    if is_structural(box):
        return _column(walk, hw, column, ())
    moves: list[tuple[Level, Level, Array, Expr]] = []
    extra = []
    writes = dram = ZERO
    if box.transfers:
        src, dst = walk.arrays[ins[0]], walk.arrays[outs[0]]
        inner = max(src.level, dst.level)
        k = kernels[walk.root(outs[0] if dst.level == inner else ins[0])]
        loop = k.visited if any(src.has(s) for s in k.streamed) else sympy.Integer(1)
        reread = _groups(src, k.grid) * loop
        moves.append((min(src.level, dst.level), inner, src, reread))
        if dst.level == HBM:
            writes = dram = src.size * src.dtype.bytes
        elif src.level == HBM and reread == 1:
            dram = src.size * src.dtype.bytes
        elif src.level == HBM:
            k.rereads.append((src, reread))  # DRAM bytes once the kernel's L2 working set is known
    elif any(walk.arrays[i].level == HBM for i in ins + outs):  # a kernel of its own
        tiled = walk.labelled(ins + outs, "group")
        scheduled = tiled or walk.labelled(ins + outs, "stream")
        for i in ins + outs:
            a = walk.arrays[i]
            if a.level == HBM:
                moves.append((HBM, onchip, a, _groups(a, {n: t.groups for n, t in tiled.items()})))
                if i in outs:
                    writes += a.size * a.dtype.bytes
                if scheduled:  # an unscheduled kernel's on-chip working set is not ours to know
                    extra.append((onchip, a.local_size, a.local_size * a.dtype.bytes))
        dram = sympy.Add(*(a.size * k * a.dtype.bytes for _, _, a, k in moves))  # no reuse model: every read
    record = _column(walk, hw, column, extra)
    tensor = sympy.sympify(box.tensor_flops()) * visited
    narrowest = min((w.dtype for w in box.dom.inside), key=lambda t: t.bits, default=f32)
    return replace(
        record,
        flops=(sympy.sympify(box.flops()) + rescale[0]) * visited,
        transcendentals=(sympy.sympify(box.transcendentals()) + rescale[1]) * visited,
        tensor_flops={narrowest: tensor} if tensor != 0 else {},
        moves=_add(*({(o, i): a.size * k} for o, i, a, k in moves)),
        move_bytes=_add(*({(o, i): a.size * k * a.dtype.bytes} for o, i, a, k in moves)),
        dram_bytes=dram,
        gmem_write_bytes=writes,
    )
