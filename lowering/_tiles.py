"""Open partition sizes chosen from the cost model (FAN §4: the largest tile that fits, ties broken by the
predicted time), for any scheduled diagram.

A derivation may leave sizes open (``tile(q)``, ``stream(x, "auto")``: the symbols ``g_q``, ``s_x``).
:func:`choose_tiles` tries every power of two from 16 (the smallest block a 16-bit dot takes) to 256 for each
open size, keeps those that fit one block's shared memory twice over — the lowering's own footprint (resident
blocks plus ``stages`` buffers of each chunk, :func:`lowering._plan.smem_bytes`) and the cost functor's
largest on-chip column (which also holds the scores and accumulators) — and, among those, takes the largest
tiles, then the fastest predicted (:attr:`napkin_cat.Cost.time_serial` of the diagram's own cost at those
sizes), then the largest chunks. Here rather than in :mod:`napkin_cat.optimize` because a prediction needs a
*scheduled* diagram, which only :mod:`rewrites` derives.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> b, h, q, x = nc.axes("b h q x")
>>> mha = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 128), batch=(b,), dtype="bf16")
>>> flash = derive(mha, tile(q), stream(x), verify=False)
>>> print(choose_tiles(flash, "H100", {"b": 4, "h": 16, "q": 4096, "x": 4096}))
tile(q, 256), stream(x, 64) on H100: largest tiles whose blocks fit 232,448 B, then fastest predicted (1.196 ms)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy

from lowering._plan import NotLowerable, block_values, next_pow2, plan, smem_bytes
from lowering.triton import STAGES, TRITON_BLOCKS, Config, launch
from napkin_cat import Cost, cost
from napkin_cat.diagram import Diagram
from napkin_cat.errors import NapkinError
from napkin_cat.hardware import Hardware, lookup
from napkin_cat.levels import SMEM
from rewrites import RewriteError, derive, level, open_sizes, resolve, stream, tile

__all__ = [
    "Choice",
    "Chunks",
    "Occupancy",
    "choose_tiles",
    "fit_blocks",
    "occupancy",
    "predicted_occupancy",
    "predicted_time",
]

#: the sizes tried for an open partition: Triton's blocks are powers of two ≥ 16 (16-bit dots need K ≥ 16);
#: above 256 no block fits an H100's shared memory beside another operand at D ≥ 64
CANDIDATES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Choice:
    """The sizes chosen for a diagram's open partitions, and why.

    ``open`` names the open sizes as rules (``"tile(q)"``), ``sizes`` maps their symbols' names to the sizes
    chosen, in the same order; ``predicted`` is :attr:`Cost.time_serial` in seconds at ``at`` (the problem
    sizes it was evaluated at); ``ranked`` lists every candidate that fits, best first by the model; ``how``
    is ``"cost model"`` or ``"measured search"`` (then ``measured`` holds the seconds measured).

    >>> c = Choice(("tile(q)",), {"g_q": 64}, 1e-3, {"q": 512}, "H100", 232448, ({"g_q": 64},))
    >>> c, c.rules
    (Choice(tile(q, 64) on H100), ('tile(q, 64)',))
    """

    open: tuple
    sizes: dict
    predicted: float
    at: dict
    hardware: str
    smem: int
    ranked: tuple = field(default=(), repr=False)
    how: str = "cost model"
    measured: float | None = None

    @property
    def rules(self) -> tuple[str, ...]:
        """The chosen sizes as the rules that would have given them."""
        return tuple(f"{o[:-1]}, {n})" for o, n in zip(self.open, self.sizes.values(), strict=True))

    def __repr__(self):
        return f"Choice({', '.join(self.rules)} on {self.hardware})"

    def __str__(self):
        why = (
            f"largest tiles whose blocks fit {self.smem:,} B, then fastest predicted ({_seconds(self.predicted)})"
            if self.how == "cost model"
            else f"fastest measured ({_seconds(self.measured)}; the model predicted {_seconds(self.predicted)})"
        )
        return f"{', '.join(self.rules)} on {self.hardware}: {why}"


def _costed(d: Diagram) -> Diagram:
    """The diagram as one kernel for the cost functor: its interior recoloured to SMEM, as the lowering runs it."""
    if any(w.level == SMEM for b in d.boxes for w in b.cod.inside):
        return d
    try:
        return level(SMEM)(d)
    except RewriteError:  # already has level changes of its own: cost it as written
        return d


def missing_sizes(d: Diagram, sizes: Mapping[str, int] | None = None) -> list[str]:
    """The axes of ``d`` whose size is neither concrete nor in ``sizes``, by name.

    >>> import napkin_cat as nc
    >>> missing_sizes(nc.library.attention(*nc.axes("q x d", d=64)), {"q": 8})
    ['x']
    """
    names = dict.fromkeys(a.name for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if not a.size.is_number)
    return [n for n in names if n not in (sizes or {})]


def _problem_sizes(d: Diagram, sizes: Mapping[str, int] | None, why: str) -> dict[str, int]:
    """Every axis's size by name: the diagram's own where concrete, else ``sizes``; else a NotLowerable."""
    out, missing = {}, []
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            if a.size.is_number:
                out[a.name] = int(a.size)
            elif sizes is not None and a.name in sizes:
                out[a.name] = int(sizes[a.name])
            elif a.name not in missing:
                missing.append(a.name)
    if missing:
        opens = ", ".join(map(str, open_sizes(d)))
        raise NotLowerable(
            f"{opens} is open and {why} needs the size of {', '.join(missing)}, which the diagram leaves symbolic: "
            f"give each a size (nc.Axis({missing[0]!r}, n)) or pass lower(..., sizes={{{missing[0]!r}: n, ...}})"
        )
    return out


@dataclass(frozen=True)
class Occupancy:
    """How a kernel's grid runs on a GPU: ``blocks`` in the grid, ``per_sm`` of them resident on each SM
    (``limit`` names the resource that bounds it), and the bytes a block moves outside its loop:
    ``prologue`` before its first compute, ``epilogue`` after its last.

    >>> from napkin_cat.hardware import H100
    >>> Occupancy(blocks=264, per_sm=1, limit="shared memory", prologue=0, epilogue=0).waves(H100)
    2
    """

    blocks: int
    per_sm: int
    limit: str
    prologue: int
    epilogue: int
    registers: int = 0

    def waves(self, hw: Hardware) -> int:
        """Rounds of ``SMs × per_sm`` blocks the grid needs (the last one possibly partial)."""
        return -(-self.blocks // (hw.sms * self.per_sm))

    def time(self, times: Mapping[str, float], hw: Hardware) -> float:
        """Seconds for a kernel whose per-resource ``times`` (:attr:`Cost.kernel_times`: the work spread
        evenly over every SM) run in waves.

        Each wave runs ``SMs × per_sm`` blocks: their share of the compute (tensor + CUDA cores + exp unit,
        in series as in :attr:`Cost.time_serial`), after their prologue and before their epilogue, which all
        blocks of a wave move at once through the link into shared memory; a partial last wave costs a whole
        one (wave quantization). The links' bytes are shared by whichever blocks run, so a link-bound kernel
        takes its slowest link's time, as in :attr:`Cost.time_serial`.

        >>> from napkin_cat.hardware import H100
        >>> o = Occupancy(blocks=133, per_sm=1, limit="warps", prologue=0, epilogue=0)
        >>> round(o.time({"tensor": 1.0, "vector": 0.0, "sfu": 0.0, "→SMEM": 0.5}, H100), 4)  # two waves of 132
        1.985
        """
        slots = hw.sms * self.per_sm
        compute = times["tensor"] + times["vector"] + times["sfu"]
        moved = slots * (self.prologue + self.epilogue) / hw.bandwidth(SMEM)
        links = [t for k, t in times.items() if k.startswith("→")]
        return max(*links, self.waves(hw) * (compute * slots / self.blocks + moved))


def occupancy(p, padded: Mapping[str, int], config: Config, hw: Hardware, live_values=None) -> Occupancy:
    """The grid, blocks resident per SM and per-block prologue/epilogue bytes of a plan's kernel.

    Blocks per SM is the least of: the hardware's resident-block limit; its warps over the block's
    (``config.num_warps``); its shared memory over the block's footprint (resident blocks plus ``stages``
    buffers of each chunk, :func:`lowering._plan.smem_bytes`) plus the per-block reservation; its
    registers over the block's, where a thread holds ``live_values`` (the block's on-chip values that
    shared memory does not stage, one 32-bit register each, at most the hardware's per-thread limit: a
    lower bound, since Triton also keeps addresses and temporaries) rounded up to the allocation unit.
    The prologue is what the first iteration waits for: the resident input blocks and the first chunk
    (Triton's pipeliner issues ``stages − 1`` chunks before its loop, served in order, and the later ones
    arrive under the first iteration's compute); the epilogue writes the output blocks.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> b, h, q, x = nc.axes("b h q x")
    >>> mha = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 128), batch=(b,), dtype="bf16")
    >>> p = plan(derive(mha, tile(q, 128), stream(x, 64), verify=False).diagram)
    >>> from napkin_cat.hardware import H100
    >>> o = occupancy(p, {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}, Config(8, 3), H100)
    >>> o.blocks, o.per_sm, o.limit, o.prologue // 1024, o.epilogue // 1024
    (2048, 1, 'shared memory', 64, 32)
    """
    tiles = [padded[a] // g for a, g in p.tiles.items()]
    blocks = math.prod(tiles) * math.prod(padded[a] for a in p.batch)
    smem = smem_bytes(p, padded, config.num_stages)
    prologue = smem_bytes(p, padded, 1)  # the resident blocks and the first chunk: the loop waits for nothing more
    epilogue = sum(block_values(p, w, padded) * w.dtype.bytes for w in p.diagram.cod.inside)
    threads = config.num_warps * hw.warp_size
    per_thread = hw.max_regs_per_thread
    if live_values is not None:
        per_thread = min(per_thread, max(1, -(-int(live_values) // threads)))
    unit = hw.reg_alloc_unit // hw.warp_size  # registers per thread in one allocation unit
    registers = -(-per_thread // unit) * unit
    limits = {
        "resident blocks": hw.max_blocks_per_sm,
        "warps": hw.max_warps_per_sm // config.num_warps,
        "shared memory": hw.capacity(SMEM) // (smem + hw.smem_reserved_per_block),
        "registers": hw.regs_per_sm // (threads * registers),
    }
    limit = min(limits, key=limits.get)
    return Occupancy(blocks, max(1, limits[limit]), limit, prologue, epilogue, registers)


def _live_values(c: Cost, p, sizes: Mapping[str, int], padded: Mapping[str, int]) -> int:
    """The block's on-chip values outside shared memory: the cost functor's largest column at one block,
    less the input blocks shared memory stages."""
    per_block = {**sizes, **dict.fromkeys(p.batch, 1)}
    column = c.subs(**per_block).memory.get(SMEM, sympy.Integer(0))
    staged = sum(block_values(p, w, padded) for w in p.diagram.dom.inside)
    return max(0, int(column) - staged) if column.is_number else 0


def _occupancy_at(
    c: Cost, d: Diagram, sizes: Mapping[str, int], hw: Hardware, stages: int, warps: int | None = None
) -> Occupancy | None:
    """The occupancy of ``d``'s kernel at ``sizes``; None when the diagram does not lower to one kernel there."""
    try:
        p = plan(d)
        extent = _problem_sizes(d, sizes, "the predicted time")
        padded = launch(p, extent, Config(num_stages=stages), hw)
    except NotLowerable:
        return None
    config = Config(num_warps=warps or Config.get_default(p).num_warps, num_stages=stages)
    return occupancy(p, padded, config, hw, _live_values(c, p, {**extent, **sizes}, padded))


def _kernel_time(
    c: Cost, d: Diagram, sizes: Mapping[str, int], hw: Hardware, stages: int, warps: int | None = None
) -> float:
    """``c`` at ``sizes``, run in waves with its blocks' prologue and epilogue (:meth:`Occupancy.time`);
    :attr:`Cost.time_serial` alone when the diagram does not lower to one kernel."""
    numbers = c.subs(**sizes)
    o = _occupancy_at(c, d, sizes, hw, stages, warps)
    if o is None:
        return float(numbers.time_serial)
    return o.time({k: float(v) for k, v in numbers.kernel_times.items()}, hw)


def predicted_occupancy(
    scheduled, hardware: Hardware | str, sizes: Mapping[str, int], *, stages: int = STAGES, warps: int | None = None
):
    """The :class:`Occupancy` :func:`predicted_time` runs a scheduled diagram's kernel at (None if it does not
    lower to one kernel at ``sizes``).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> mm = derive(nc.library.matmul(n, k, c, dtype="bf16"), tile(n, 128), tile(c, 128), stream(k, 64), verify=False)
    >>> o = predicted_occupancy(mm, "H100", {"n": 4096, "k": 4096, "c": 4096})
    >>> o.blocks, o.per_sm, o.limit, o.waves(lookup("H100"))
    (1024, 2, 'shared memory', 4)
    """
    d = getattr(scheduled, "diagram", scheduled)
    hw = lookup(hardware)
    return _occupancy_at(cost(_costed(d), hw), d, sizes, hw, stages, warps)


def predicted_time(
    scheduled, hardware: Hardware | str, sizes: Mapping[str, int], *, stages: int = STAGES, warps: int | None = None
) -> float:
    """Seconds the cost model predicts for a scheduled diagram (or Derivation) at ``sizes`` (by axis name, and
    by symbol name for open partition sizes): :attr:`Cost.time_serial` of its cost, run as one kernel, in
    waves of the blocks the SMs hold at once, each wave with its blocks' prologue and epilogue
    (:func:`occupancy`, :meth:`Occupancy.time`; ``stages`` and ``warps`` as the kernel runs them, by default
    :meth:`lowering.TritonConfig.get_default`'s).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16")
    >>> flash = derive(mha, tile(q, 128), stream(x, 64), verify=False)
    >>> round(predicted_time(flash, "H100", {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}) * 1e3, 3)
    1.198
    """
    d = getattr(scheduled, "diagram", scheduled)
    hw = lookup(hardware)
    return _kernel_time(cost(_costed(d), hw), d, sizes, hw, stages, warps)


def _fits(d: Diagram, c: Cost, choice: dict, at: dict, stages: int, hw: Hardware) -> bool:
    p = plan(resolve(d, choice))
    try:
        launch(p, at, Config(num_stages=stages), hw)
    except NotLowerable:
        return False
    per_block = {**at, **dict.fromkeys(p.batch, 1)}  # a block holds one element of each batch axis
    column = c.subs(**choice, **per_block).memory_bytes.get(SMEM, sympy.Integer(0))
    return bool(column <= hw.smem_per_block)


def choose_tiles(
    scheduled,
    hardware: Hardware | str,
    sizes: Mapping[str, int] | None = None,
    *,
    stages: int = STAGES,
    candidates: tuple[int, ...] = CANDIDATES,
) -> Choice:
    """Sizes for the open partitions of a scheduled diagram (or Derivation) on ``hardware``, from its cost.

    ``sizes`` gives the sizes of axes the diagram leaves symbolic (by name); the shared-memory test needs
    every axis kept whole in a block, the predicted time every axis. ``stages`` is the pipeline depth the
    kernel will run (:data:`lowering.triton.STAGES`, as :meth:`lowering.TritonConfig.get_default`). Raises
    :class:`NotLowerable` naming the open sizes when a size they need is unknown, or when no candidate fits.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> mm = derive(nc.library.matmul(n, k, c, dtype="bf16"), tile(n), tile(c), stream(k), verify=False)
    >>> choose_tiles(mm, "H100", {"n": 4096, "k": 4096, "c": 4096}).sizes
    {'g_n': 256, 's_k': 32, 'g_c': 256}
    >>> choose_tiles(derive(nc.library.attention(*nc.axes("q x d")), tile("q"), verify=False), "H100")
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: tile(q) is open and the predicted time needs the size of q, d, x, which the \
diagram leaves symbolic: give each a size (nc.Axis('q', n)) or pass lower(..., sizes={'q': n, ...})
    """
    d = getattr(scheduled, "diagram", scheduled)
    hw = lookup(hardware)
    opens = open_sizes(d)
    if not opens:
        raise NotLowerable("choose_tiles: the diagram has no open partition sizes (tile(a) or stream(x) without one)")
    at = _problem_sizes(d, sizes, "the predicted time")
    try:
        c = cost(_costed(d), hw)
    except NapkinError as e:
        raise NotLowerable(f"{', '.join(map(str, opens))}: the cost model cannot cost this diagram: {e}") from e
    fixed = {a.name: int(a.size) for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.size.is_number}

    def allowed(o) -> list[int]:  # a block no wider than the padded axis; a concrete axis bounds it exactly
        top = fixed.get(o.axis, max(next_pow2(at[o.axis]), candidates[0]))
        return [n for n in candidates if n <= top]

    per = [allowed(o) for o in opens]
    if not all(per):
        small = [str(o) for o, p in zip(opens, per, strict=True) if not p]
        raise NotLowerable(
            f"{', '.join(small)}: the axis is smaller than the smallest block ({candidates[0]}); tile or stream "
            "another axis, or give the size"
        )
    fitting = []
    for combo in itertools.product(*per):
        choice = {o.symbol.name: n for o, n in zip(opens, combo, strict=True)}
        if _fits(d, c, choice, at, stages, hw):
            fitting.append(choice)
    if not fitting:
        raise NotLowerable(
            f"{', '.join(map(str, opens))}: no size in {candidates} fits {hw.name}'s {hw.smem_per_block:,} B of "
            f"shared memory per block at {_show(at)} with {stages} stages"
        )
    tiles = [o.symbol.name for o in opens if o.rule == "tile"]
    streams = [o.symbol.name for o in opens if o.rule == "stream"]

    def predicted(choice: dict) -> float:
        return _kernel_time(c, resolve(d, choice), {**at, **choice}, hw, stages)

    def key(choice: dict):
        t = predicted(choice)
        size = lambda names: math.prod(choice[n] for n in names)  # noqa: E731
        return (-size(tiles), float(f"{t:.3g}"), -size(streams))

    ranked = tuple(sorted(fitting, key=key))
    best = ranked[0]
    return Choice(tuple(map(str, opens)), best, predicted(best), at, hw.name, hw.smem_per_block, ranked)


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-4 else f"{t * 1e6:.2f} µs"


def _show(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


@dataclass(frozen=True)
class Chunks:
    """A backend's own chunks for :func:`fit_blocks`: the ``largest`` it streams, the ``smallest`` it takes,
    ``admits``, whether it lowers a scheduled diagram (its checks before compiling: shared memory, registers), and
    whether ``triton`` must run the same schedule too (``backend="auto"``: a shape Mosaic cannot take, known only
    when called, runs on the Triton kernel of the same diagram)."""

    largest: int
    smallest: int
    admits: Callable[[Diagram], bool]
    triton: bool = False


def fit_blocks(
    naive: Diagram,
    tiled: list,
    streamed: list,
    tile_size: int,
    stream_size: int,
    hardware: Hardware,
    config: Config | None,
    own: Chunks | None = None,
    summed: bool = False,
) -> tuple[tuple, Diagram]:
    """The rules and scheduled diagram of one kernel (a backward piece's, the attention entry's): ``tiled`` axes
    in blocks of ``tile_size``, ``streamed`` in chunks of ``stream_size``, halved (the stream first, then the
    tile, to 16) while the kernel's shared memory (:func:`lowering._plan.smem_bytes`, at the padded sizes of the
    axes kept whole, where the diagram knows them, with ``config``'s stages or Triton's default) exceeds
    ``hardware.smem_per_block``; :class:`NotLowerable` where even 16 × 16 blocks exceed it. A backend with blocks
    and checks of its own passes them as ``own`` (:class:`Chunks`) instead: the stream halves while
    ``own.admits`` refuses (or, with ``own.triton``, Triton's shared memory does at the stages its policy would run
    the stand-in, :meth:`~lowering.triton.TritonBlocks.config`), down to ``own.smallest``; then,
    where the backend refuses even that, the largest halved tile (down to ``own.smallest``) it admits, if any.
    ``summed``: the tiled axes admit contractions summing into outputs (``tile(a, g, summed=True)``).

    A bias streamed beside K and V takes its share: at D = 128 an f32 [q, x] bias block of 128 × 128 in three
    stages alone is 196,608 B, so 128-key chunks halve to 64.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H100
    >>> q, x = nc.axes("q x")
    >>> d = nc.Axis("d", 128)
    >>> biased = nc.library.dot_product_attention(q, x, d, dtype="bf16", bias_batch=(), bias_dtype="f32")
    >>> fit_blocks(biased, ["q"], ["x"], 128, 128, H100, None)[0]
    (tile(q, 128), stream(x, 64))
    """
    known = {a.name: int(a.size) for w in naive.dom.inside for a in w.axes if a.size.is_number}
    while True:
        rules = tuple(tile(a, tile_size, summed) for a in tiled) + tuple(stream(a, stream_size) for a in streamed)
        scheduled = derive(naive, *rules, verify=False).diagram
        p = plan(scheduled)
        if not all(a in known for a in p.whole):
            return rules, scheduled
        padded = {a: max(next_pow2(known[a]), 16) for a in p.whole}
        # blocks are halved to fit the policy's depth; a kernel handed blocks fewer stages hold (deepest) takes fewer
        stages = (config or TRITON_BLOCKS.config(p, fit=False)).num_stages
        smem = smem_bytes(p, padded, stages)
        fits = smem <= hardware.smem_per_block
        if own is not None:  # the backend's own checks (shared memory among them), and Triton's where it stands in
            admitted = own.admits(scheduled)
            # a Triton kernel standing in (a shape the backend cannot take) runs at its policy's config, the deepest
            # stages that fit (down to 2), so it need only fit there: dQ at D = 128 keeps Mosaic's 128-key chunks
            stand_in = (config or TRITON_BLOCKS.config(p)).num_stages
            if admitted and (smem_bytes(p, padded, stand_in) <= hardware.smem_per_block or not own.triton):
                return rules, scheduled
            if streamed and stream_size // 2 >= own.smallest:
                stream_size //= 2
                continue
            if not admitted and tiled and tile_size // 2 >= own.smallest:  # a smaller tile the backend takes (the
                # wide head dims' backward), else these blocks
                smaller = fit_blocks(naive, tiled, streamed, tile_size // 2, stream_size, hardware, config, own, summed)
                if own.admits(smaller[1]):
                    return smaller
            return rules, scheduled  # where even the smallest fails, the backend names why when lowering
        if fits:
            return rules, scheduled
        if streamed and stream_size > 16:
            stream_size //= 2
        elif tiled and tile_size > 16:
            tile_size //= 2
        else:
            raise NotLowerable(
                f"the kernel {naive.dom} → {naive.cod} ({', '.join(map(str, rules))}) would hold "
                f"{smem:,} B of shared memory ({stages} stages of each chunk), over the "
                f"{hardware.smem_per_block:,} B a block may use on {hardware.name}, even at 16-element blocks"
            )
