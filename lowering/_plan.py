"""The plan of a kernel: how a scheduled diagram's axes map onto a Pallas grid, blocks and loops.

Reading the partition labels (the lowering functor on objects): tiled axes become grid dimensions
with blocks of ``g``; axes no box combines elements along (batch, heads) become grid dimensions
with squeezed blocks; the streamed axis becomes the in-kernel loop, in chunks of ``s``; every other
axis stays whole inside the block. The guards of the Triton backend are checked here, before any
compilation, and raise :class:`NotLowerable`.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> b, h, q, x, d = nc.axes("b h q x d", d=64)
>>> flash = derive(nc.library.multi_head_attention(h, q, x, d, batch=(b,)), tile(q, 128), stream(x, 64), verify=False)
>>> p = plan(flash.diagram)
>>> p.tiles, p.stream, p.batch, p.whole
({'q': 128}, ('x', 64), ('b', 'h'), ('d',))
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

import rewrites
from napkin_cat.diagram import Diagram, is_structural
from napkin_cat.errors import NapkinError
from napkin_cat.generators import Captured, Generator, fname
from rewrites import LOG2E as LOG2E  # the rules live in rewrites; these names stay importable here
from rewrites import Neutral as Neutral
from rewrites import neutral_padding as neutral_padding
from rewrites import open_sizes, partitions, summed_outputs


class NotLowerable(NapkinError, ValueError):
    """The lowering cannot produce a kernel for this diagram; the message says which box or axis and why.

    >>> from lowering import Config
    >>> Config(num_warps=3)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: TritonConfig: num_warps must be one of 1, 2, 4, 8, 16, 32, got 3
    """


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class Plan:
    """Where each axis of a scheduled diagram goes in a kernel: the grid (tiled axes, in blocks of ``g``;
    batch axes, squeezed), the in-kernel loop (the streamed axis, in chunks of ``s``) or whole in every block.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> p = plan(derive(nc.library.matmul(n, k, c), tile(n, 64), tile(c, 64), stream(k, 32), verify=False).diagram)
    >>> p.tiles, p.stream, p.batch, p.whole
    ({'n': 64, 'c': 64}, ('k', 32), (), ())
    """

    tiles: dict  # tiled axis -> g
    stream: tuple | None  # (axis, s)
    batch: tuple  # axes mapped to a flattened grid dimension, block 1
    whole: tuple  # axes kept whole in every block
    diagram: Diagram
    written: tuple = ()  # outputs carrying the streamed axis (by position): each chunk's slice written once
    #: outputs summed over tiled axes (by position: the axes): each program's partial sums added into them
    #: (``tile(a, g, summed=True)``: FlashAttention-3's dQ, summed over the key tiles of the kernel tiling keys)
    summed: dict = field(default_factory=dict)


def pow2_blocks(p: Plan) -> str | None:
    """Why Triton's blocks cannot take ``p``'s tiles and chunks (each a power of two ≥ 16, or a chunk of 1 along an
    axis only summed), else None: Triton's guard, not the plan's (Mosaic splits a tile of 384 over three warpgroups).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> pow2_blocks(plan(derive(nc.library.attention(q, x, d), tile(q, 24), stream(x, 16), verify=False).diagram))
    "axis 'q': Triton blocks need a power-of-two tile ≥ 16, got g = 24"
    """
    for a, g in p.tiles.items():
        if not _pow2(g) or g < 16:
            return f"axis {a!r}: Triton blocks need a power-of-two tile ≥ 16, got g = {g}"
    if p.stream is not None and p.stream[1] != 1 and (not _pow2(p.stream[1]) or p.stream[1] < 16):
        return (
            f"axis {p.stream[0]!r}: Triton blocks need a power-of-two stream size ≥ 16 (or 1 along an axis only "
            f"summed), got s = {p.stream[1]}"
        )
    return None


def plan(d: Diagram) -> Plan:
    """Classify the axes of a scheduled diagram and check the guards that need no sizes.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 384), stream(x, 64), verify=False).diagram)
    >>> p.tiles, p.stream, p.whole   # any block sizes: each backend's guards say which it takes (Triton: powers of 2)
    ({'q': 384}, ('x', 64), ('d',))
    """
    if opens := open_sizes(d):
        raise NotLowerable(
            f"{', '.join(map(str, opens))}: the size is open; lower() chooses it (or bind it with rewrites.resolve)"
        )
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise NotLowerable(f"one streamed axis per kernel, got {sorted(streams)}")
    if len(tiles) > 2:
        raise NotLowerable(f"at most two tiled axes fit the Triton grid (≤ 3 dims), got {sorted(tiles)}")
    stream = next(iter(streams.items()), None)
    summed = {}  # the tiled axes that outputs are sums over (tile(a, g, summed=True)), each with those outputs
    for a in tiles:
        positions, why = summed_outputs(d, a)
        if positions and why is None:
            summed[a] = positions
    mixed, names = set(), []
    for box in d.boxes:
        if is_structural(box) or getattr(box, "transfers", False):
            continue
        if not isinstance(box, Generator):
            raise NotLowerable(f"box {box.name!r} is not a generator the lowering knows")
        _check_closure(box)
        mixed |= {a for a in box.mixes if not (a in summed and a in box.reduced)}  # a sum into an output: added
    for w in (*d.dom.inside, *d.cod.inside):
        names += [n for n in w.names if n not in names]
    for a in tiles:
        if a in mixed:
            raise NotLowerable(f"axis {a!r} is tiled but a box combines elements along it")
    if stream is not None and stream[1] == 1:
        _check_unit_stream(d, stream[0])
    streamed = {stream[0]} if stream else set()
    whole = kept_whole(d)
    batch = tuple(n for n in names if n not in whole and n not in tiles and n not in streamed)
    _check_contractions(d, streamed)
    written = tuple(i for i, w in enumerate(d.cod.inside) if streamed & set(w.names))
    by_output = {k: tuple(a for a in summed if k in summed[a]) for k in sorted(set().union(*summed.values()))}
    return Plan(dict(tiles), stream, batch, whole, d, written, by_output)


def kept_whole(d: Diagram) -> tuple[str, ...]:
    """The axes every block of a kernel of ``d`` holds whole: some box combines elements along them, and they are
    neither tiled nor streamed (:attr:`Plan.whole`; read without planning, so with partition sizes still open).

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> b, q, x, d = nc.axes("b q x d")
    >>> kept_whole(stream(x)(tile(q)(nc.library.attention(q, x, d, batch=(b,)))))
    ('d',)
    """
    tiles, streams = partitions(d)
    boxes = [box for box in d.boxes if isinstance(box, Generator) and not box.transfers]
    mixed = {n for box in boxes for n in box.mixes}
    names = dict.fromkeys(n for w in (*d.dom.inside, *d.cod.inside) for n in w.names)
    # an axis a product's output lacks (MLA's value head dim, absent from QKᵀ) is kept whole too: on the grid,
    # every program along it would recompute that product
    unshared = {n for box in boxes if box.contracts for n in names if not any(w.has(n) for w in box.cod.inside)}
    return tuple(n for n in names if n in mixed | unshared and n not in tiles and n not in streams)


def _check_unit_stream(d: Diagram, x: str):
    """A stream of one element at a time: each chunk's blocks keep a unit ``x`` (dropped by the dots, which
    see 2-D blocks), so no product may contract ``x``; only a sum of one array (a batch axis summed, as a
    bias shared by the batch sums its cotangent) may reduce it.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> plan(derive(nc.library.matmul(n, k, c), tile(n, 64), tile(c, 64), stream(k, 1), verify=False).diagram)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: box 'n k, k c → n c' contracts 'k' over 2 operands: a stream of 1 along 'k' \
would make each chunk's product a sum of one term; stream it in chunks that are a power of two ≥ 16
    """
    for box in d.boxes:
        if not is_structural(box) and box.contracts and x in box.reduced and len(box.dom) > 1:
            raise NotLowerable(
                f"box {box.name!r} contracts {x!r} over {len(box.dom)} operands: a stream of 1 along {x!r} would "
                "make each chunk's product a sum of one term; stream it in chunks that are a power of two ≥ 16"
            )


def _check_contractions(d: Diagram, streamed: set):
    for box in d.boxes:
        if not is_structural(box) and box.contracts:
            for a in box.reduced:
                # a sum of one array (a cotangent unbroadcast) is a block sum; a product summing an axis
                # only one of its operands has is refused
                if a not in streamed and len(box.dom) > 1 and len([w for w in box.dom.inside if w.has(a)]) < 2:
                    raise NotLowerable(f"box {box.name!r}: a contraction over {a!r} must involve two operands")


def pad_neutral(d: Diagram, axis: str, extent: int) -> Diagram:
    """``d`` after the rule :class:`rewrites.pad_neutral` (its side condition checks each padding neutral).

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> [b.name for b in pad_neutral(nc.library.rms_norm(n, d), "d", 3).boxes][2:4]
    ['pad d ≥ 3 with 0.0', 'sum d']
    """
    return rewrites.pad_neutral(axis, extent)(d)


#: packages whose functions and objects hold no user's arrays: the walk of :func:`_captured` does not enter them
_LIBRARIES = frozenset({"jax", "jaxlib", "numpy", "sympy", "builtins", "math", "functools", "operator", "inspect"})
#: what the walk never enters: values without parts, modules, classes
_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)
#: what the walk enters even though its type is a library's: it holds the user's values
_CONTAINERS = (tuple, list, dict, functools.partial)
_GLOBAL_LOADS, _ATTR_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}, {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}
_EMPTY = object()


def _refused(v) -> bool:
    """Whether ``v`` is a constant Pallas refuses to capture (it asks for it as an input): a JAX array of any rank,
    0-d included, or a numpy array of rank ≥ 1. A Python number, a numpy scalar or a 0-d numpy array becomes a
    literal of the kernel and is fine."""
    return isinstance(v, jax.Array) or (isinstance(v, np.ndarray) and v.ndim > 0)


@functools.lru_cache(maxsize=1024)
def _reads(code) -> tuple[frozenset, frozenset]:
    """The global names and the attribute names a code object reads, with those of the functions it defines."""
    found, attrs = set(), set()
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_LOADS:
            found.add(ins.argval)
        elif ins.opname in _ATTR_LOADS:
            attrs.add(ins.argval)
    for c in code.co_consts:
        if inspect.iscode(c):
            g, a = _reads(c)
            found |= g
            attrs |= a
    return frozenset(found), frozenset(attrs)


def _holder(f) -> str:
    """A function's name in messages: its qualified name, without ``<locals>`` (``make.<lambda>``)."""
    return f.__qualname__.replace("<locals>.", "")


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a free variable not bound yet
        return None


def _function_parts(f: types.FunctionType) -> list:
    """A Python function's free variables, the globals its code reads and its defaults, each labelled by its name
    and the function; the attribute names its code reads go with them (what it may read of an object among them)."""
    code, by = f.__code__, _holder(f)
    found, attrs = _reads(code)
    cells = zip(code.co_freevars, f.__closure__ or (), strict=True)
    parts = [(n, _contents(c)) for n, c in cells]
    parts += [(n, f.__globals__[n]) for n in sorted(found) if n in f.__globals__]
    defaults = f.__defaults__ or ()
    named = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
    parts += [(f"default {n}", v) for n, v in (*zip(named, defaults, strict=True), *(f.__kwdefaults__ or {}).items())]
    return [((what, by), v, attrs) for what, v in parts]


def _attribute(v, n: str):
    """``v``'s attribute ``n`` as its instance or class holds it, run by nothing: a property's getter, a static or
    class method's function; ``_EMPTY`` where it has none."""
    x = inspect.getattr_static(v, n, _EMPTY)
    if isinstance(x, property):
        return x.fget
    return x.__func__ if isinstance(x, staticmethod | classmethod) else x


def _parts(v, label: tuple, attrs: frozenset | None) -> list:
    """What a call of ``v`` may read, one level down: ``(label, value, attribute names read there)`` triples, a
    label being ``(what, where)``: a variable's name (an item's, an attribute's) and the function holding it."""
    what, where = label
    if isinstance(v, tuple | list):
        return [((f"{what}[{i}]", where), x, attrs) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return [((f"{what}[{k!r}]", where), x, attrs) for k, x in v.items()]
    if isinstance(v, types.FunctionType):
        return _function_parts(v)
    if isinstance(v, functools.partial):
        inner = _reads(v.func.__code__)[1] if isinstance(v.func, types.FunctionType) else None
        given = [*enumerate(v.args), *v.keywords.items()]
        by = f"partial {fname(v.func)}"
        return [(label, v.func, attrs)] + [((f"argument {k}", by), x, inner) for k, x in given]
    if inspect.ismethod(v):
        func = v.__func__
        own = _reads(func.__code__)[1] if isinstance(func, types.FunctionType) else frozenset()
        return [(label, func, attrs), (("self", _holder(func)), v.__self__, own)]
    parts = [(label, v.__wrapped__, attrs)] if hasattr(v, "__wrapped__") else []
    call = inspect.getattr_static(type(v), "__call__", None)
    if isinstance(call, types.FunctionType):  # a callable object: its __call__, and what that reads of it
        parts.append((label, call, attrs))
        attrs = (attrs or frozenset()) | _reads(call.__code__)[1]
        what, where = what or "self", where or _holder(call)
    names, held = set(attrs if attrs is not None else getattr(v, "__dict__", {})), {}
    while missing := names - held.keys():
        for n in missing:
            held[n] = _attribute(v, n)
            if isinstance(held[n], types.FunctionType):  # a method: what it reads of the object is read too
                names |= _reads(held[n].__code__)[1]
    return parts + [((f"{what}.{n}", where), x, frozenset(names)) for n, x in sorted(held.items()) if x is not _EMPTY]


def _captured(fn: Callable) -> dict:
    """The arrays a call of ``fn`` reads besides its arguments, at any depth, each labelled ``(what, where)``: its
    name and the function holding it ("" for ``fn`` itself). It finds the free variables and the globals its code
    reads, its defaults, the same of every function among them, a ``functools.partial``'s arguments, a bound
    method's or a callable object's attributes that its code reads (and theirs), the items of tuples, lists and
    dicts. Each value is visited once (cycles end); libraries' functions (jax, numpy) are not entered.

    >>> import jax.numpy as jnp
    >>> seg = jnp.arange(4)
    >>> def same(q, x): return seg[q] == seg[x]
    >>> list(_captured(lambda q, x: same(q, x) | (q == x)))
    [('seg', 'same')]
    >>> list(_captured(functools.partial(lambda ids, q, x: ids[q] == ids[x], seg)))
    [('argument 0', 'partial <lambda>')]
    >>> _captured(lambda s, q: s * 0.5 + np.float32(q))
    {}
    """
    found, seen, todo = {}, set(), [(("", ""), fn, None)]
    while todo:
        label, v, attrs = todo.pop()
        if _refused(v):
            found[label] = v
            continue
        if isinstance(v, _ATOMS) or id(v) in seen or (_library(v) and not isinstance(v, _CONTAINERS)):
            continue
        if isinstance(v, Captured):  # a converted function: the arrays it reads are its inputs
            continue
        seen.add(id(v))
        parts = _parts(v, label, attrs)
        if v is fn and isinstance(fn, types.FunctionType):  # its own variables need no "where"
            parts = [((what, ""), x, names) for (what, _), x, names in parts]
        todo += reversed(parts)
    return found


def _library(v) -> bool:
    module = getattr(v, "__module__", None)
    module = module if isinstance(module, str) else type(v).__module__
    return module.partition(".")[0] in _LIBRARIES


def _check_closure(box: Generator):
    """Refuse a box whose functions read arrays they are not given (a kernel would capture them as constants, which
    Pallas refuses), naming the box, the function, each array (where it is held, its shape) and the fixes."""
    for fn in box.params.values():
        if isinstance(fn, str) or not callable(fn) or not (arrays := _captured(fn)):
            continue
        name = fname(fn)
        shown = ", ".join(
            f"{what} {tuple(np.shape(v))}" + (f" in {where}" if where else "") for (what, where), v in arrays.items()
        )
        scalar = any(np.ndim(v) == 0 for v in arrays.values())
        raise NotLowerable(
            f"box {box.name!r}: {name} closes over arrays ({shown}); a kernel cannot capture arrays. In a diagram, "
            "make them inputs (as nc.library.document_attention does with segment ids) or compute them from the "
            "indices. nc.attention takes such a score_mod / mask_mod: it makes what the function reads of them "
            "inputs of the kernel (napkin_cat.generators.Captured); so do bias= (added to the scores), mask= (bool, "
            "[B, H, Nq, Nk]) and segment_ids= (document ids, [B, N])"
            + ("; capture a 0-d array as a Python number (float(c))" if scalar else "")
        )


def block_values(p: Plan, wire, padded: dict) -> int:
    """Values of one block of ``wire``: a tile of each tiled axis, a chunk of the streamed one, whole otherwise
    (``padded`` gives each axis's padded extent by name); batch axes are the grid's, one per program."""
    n = 1
    for a in wire.axes:
        if a.name in p.batch:
            continue
        if p.stream and a.name == p.stream[0]:
            n *= p.stream[1]
        elif a.name in p.tiles:
            n *= p.tiles[a.name]
        else:  # kept whole: ``padded`` needs only these axes
            n *= padded[a.name]
    return n


def smem_bytes(p: Plan, padded: dict, stages: int) -> int:
    """Shared memory a kernel holds: its resident input blocks, plus ``stages`` buffers of each chunk.

    ``padded`` gives each axis's padded extent by name (blocks of whole axes span it).
    """
    total = 0
    for w in p.diagram.dom.inside:
        streamed = p.stream is not None and w.has(p.stream[0])
        total += block_values(p, w, padded) * w.dtype.bytes * (stages if streamed else 1)
    return total


def base2(d: Diagram) -> Diagram:
    """``d`` after the rule :class:`rewrites.base2` (the lowering's base-2 exponent, the positive score scale
    moved into the online softmax where its probabilities meet a 16-bit value).

    >>> import sympy
    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> q, x, d = nc.axes("q x d")
    >>> fused = base2(fuse_softmax_contract(nc.library.attention(q, x, d, dtype="bf16"), "x"))
    >>> [(b.params.get("scale") == LOG2E / sympy.sqrt(d.size), b.params.get("base")) for b in fused.boxes]
    [(False, None), (True, 2)]
    """
    return rewrites.base2()(d)


def unweave(d: Diagram, axes: tuple) -> Diagram:
    """The per-block diagram: ``d`` with the grid's squeezed axes removed from every wire.

    >>> import napkin_cat as nc
    >>> h, q, x, d = nc.axes("h q x d")
    >>> print(unweave(nc.library.attention(q, x, d).weave(h), ("h",)).cod)
    q×d
    """
    return d.map_arrays(lambda w: w.with_(axes=[a for a in w.axes if a.name not in axes]))
