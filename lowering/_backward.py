"""The lowered backward of any lowered diagram: ``nc.reverse`` of it, made IO-aware, split, scheduled, lowered.

:func:`backward_of` builds, from a scheduled forward diagram ``d``:

1. the forward with residuals: each softmax·contract also outputs its log-sum-exp ``L``, and its
   output ``O`` is kept (FlashAttention-2, Dao 2023 §3.2);
2. the pullback of ``d`` (``napkin_cat._reverse``: each box differentiated by its own rule, forward
   values recomputed), rewritten by :mod:`rewrites._io_aware`: ``P = exp(S − L)``, ``Σ_x P ⊙ dP =
   Σ_d dO ⊙ O``, group sums kept until after the kernel;
3. one kernel per schedule: every input's cotangent is computed by the kernel that tiles the forward's
   tiled and streamed axes it has and streams the one it lacks (``dQ``: tile queries, stream keys;
   ``dK, dV``: tile keys, stream queries; a bias over both: tile both), derived with ``tile``/``stream``
   and lowered by the same lowering.

Score modifiers, masks and any pointwise box between the scores and the softmax·contract are
recomputed in the kernels and differentiated by their own rules; a parameter array entering that chain
(a learnable bias) gets its cotangent like any other input. Where any of this fails, the
:class:`~napkin_cat.errors.NapkinError` raised names the box and the reason.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> b = backward_of(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
>>> print(b.forward.cod)
q/16×d ⊗ q/16
>>> [(p.outputs, str(p.diagram.dom), [str(r) for r in p.rules]) for p in b.pieces]
[((0,), 'q×d ⊗ x×d ⊗ x×d ⊗ q×d ⊗ q ⊗ q×d', ['tile(q, 16)', 'stream(x, 16)']), \
((1, 2), 'q×d ⊗ x×d ⊗ x×d ⊗ q×d ⊗ q ⊗ q×d', ['tile(x, 16)', 'stream(q, 16)'])]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowering._plan import NotLowerable
from napkin_cat import Tape, pullback
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram
from napkin_cat.levels import HBM
from rewrites import delta_lemma, lse_residual, partitions, reduced, stream, tile, widened

#: the largest backward tile and stream (the backward holds more blocks than the forward)
LARGEST = 64


@dataclass(frozen=True)
class Piece:
    """One backward kernel: its naive ``diagram``, the backward inputs it reads (``inputs``: positions
    among the primal inputs, the output cotangents and the residuals), the primal inputs whose
    cotangents it gives (``outputs``), the axes of each to sum after the kernel (``sums``: positions),
    and the schedule ``rules``."""

    diagram: Diagram
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    sums: tuple[tuple[int, ...], ...]
    rules: tuple


@dataclass(frozen=True)
class Backward:
    """The forward with residuals (scheduled like ``d``), where its residuals lie among its outputs, and the
    backward's kernels. The backward's inputs are ``d``'s inputs, one cotangent per output, the residuals."""

    forward: Diagram
    residuals: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plain(d: Diagram) -> Diagram:
    """``d`` without partition labels, in HBM: the naive diagram a schedule was derived from.

    >>> import napkin_cat as nc
    >>> from rewrites import tile
    >>> q, x, d = nc.axes("q x d")
    >>> print(plain(tile(q, 16)(nc.library.attention(q, x, d))).cod)
    q×d
    """
    return d.map_arrays(lambda w: w.with_(axes=[a.unlabelled() for a in w.axes], level=HBM))


def with_residuals(d: Diagram) -> tuple[Diagram, tuple[int, ...]]:
    """``d`` whose softmax·contracts also output their log-sum-exp (normalised contractions their sum: each
    box's ``with_residual``), and the positions, among its outputs, of each one's ``L`` and ``O`` in turn
    (each is added where it is not an output already)."""
    t = Tape()
    xs = [t.input(a, "x") for a in d.dom.inside]
    kept = []

    def step(i, box, ins):
        made = box.with_residual() if isinstance(box, g.Generator) else None
        if made is not None:  # a row statistic the backward reads: kept (an output already, or added)
            out, L = t.apply(made, *ins)
            kept.append((L, out))
            return [out, L] if len(box.cod) == 2 else [out]
        return list(t.apply(box, *ins))

    outs = d.dataflow(xs, step)
    for pair in kept:
        outs += [w for w in pair if w not in outs]
    return t.diagram(outs), tuple(outs.index(w) for pair in kept for w in pair)


def _live(t: Tape, outs: list[str]) -> list[str]:
    """The tape inputs that ``outs`` depend on, in tape order."""
    live = set(outs)
    for _, ins, made in reversed(t.steps):
        if live & set(made):
            live |= set(ins)
    return [n for n in t.inputs if n in live]


def backward_of(d: Diagram) -> Backward:
    """The lowered backward's diagrams and schedules for the scheduled forward ``d`` (see the module).

    Raises a :class:`~napkin_cat.errors.NapkinError` naming the box and the reason where a cotangent
    cannot be computed by one streamed kernel (``NoDerivative``, ``RewriteError``, ``NotLowerable``).
    """
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise NotLowerable(f"the forward streams {sorted(streams)}, expected one axis")
    first = min(next(iter(tiles.values()), LARGEST), LARGEST)
    size = {a: first for a in tiles} | {a: min(s, LARGEST) for a, s in streams.items()}
    keyed = [*tiles, *streams]  # the axes a kernel may tile or stream
    forward, positions = with_residuals(d)
    t, grads = pullback(plain(d))
    residuals = lse_residual(t)
    delta_lemma(t, residuals)
    order = list(t.inputs)
    schedules: dict[tuple, list] = {}
    for i, ct in enumerate(grads):
        if ct is None:
            continue
        names = t.ty(ct).names
        missing = [a for a in keyed if a not in names]
        along = next((a for a in streams if a in missing), missing[0] if missing else None)
        extra = tuple(a for a in reduced(t, ct) if a.name != along)
        wide = widened(t, ct, extra)
        if wide is None:
            wide, extra = ct, ()
        left = [a for a in keyed if a not in t.ty(wide).names]
        if len(left) > 1:
            raise NotLowerable(
                f"the cotangent of input {i} ({t.ty(ct).describe()}) sums {left}; one kernel streams one axis"
            )
        rules = tuple(tile(a, size[a]) for a in keyed if a not in left) + tuple(stream(a, size[a]) for a in left)
        summed = tuple(range(len(names), len(names) + len(extra)))
        schedules.setdefault(tuple(map(str, rules)), []).append((i, wide, summed, rules))
    pieces = []
    for group in schedules.values():
        outs = [wide for _, wide, _, _ in group]
        inputs = _live(t, outs)
        naive = t.diagram(outs, inputs=inputs)
        pieces.append(
            Piece(
                naive,
                tuple(order.index(n) for n in inputs),
                tuple(i for i, *_ in group),
                tuple(s for *_, s, _ in group),
                group[0][3],
            )
        )
    return Backward(forward, positions, tuple(pieces))


def differentiable(primal: Callable, kernels: Callable[[], tuple], b: Backward, d: Diagram) -> Callable:
    """``primal`` (the kernel of ``d``) with a ``jax.custom_vjp`` whose backward runs lowered kernels.

    ``kernels()`` gives the forward with residuals, then one kernel per piece of ``b``; it is first
    called when the function is differentiated, so the forward never waits for (or fails because of) it.
    """
    n_out = len(d.cod)
    cot_dtypes = [w.dtype.jnp for w in d.cod.inside]

    def tupled(v):
        return v if isinstance(v, tuple) else (v,)

    @jax.custom_vjp
    def f(*xs):
        return primal(*xs)

    def f_fwd(*xs):
        outs = tupled(kernels()[0](*xs))
        res = tuple(outs[p] for p in b.residuals)
        return (outs[0] if n_out == 1 else tuple(outs[:n_out])), (xs, res)

    def f_bwd(saved, cts):
        xs, res = saved
        cts = [c.astype(t) for c, t in zip(tupled(cts), cot_dtypes, strict=True)]
        values = [*xs, *cts, *res]
        grads: list = [None] * len(xs)
        for piece, kernel in zip(b.pieces, kernels()[1:], strict=True):
            outs = tupled(kernel(*(values[i] for i in piece.inputs)))
            for i, out, summed in zip(piece.outputs, outs, piece.sums, strict=True):
                grads[i] = (jnp.sum(out.astype(jnp.float32), axis=summed) if summed else out).astype(xs[i].dtype)
        return tuple(grads)

    f.defvjp(f_fwd, f_bwd)
    return f
