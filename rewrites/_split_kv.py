"""Split-KV (FlashDecoding, Dao et al. 2023): ``split_kv(x, n)``, the group partition of a *reduced* axis.

rewrite: a diagram whose boxes remove ``x`` through accumulators  →  the same diagram with ``x`` relabelled
``(x/g) × g``, ``g = ⌈x/n⌉``: the keys are cut into ``n`` parts (fewer where ``g`` divides ``x`` into fewer), one
per program of the grid; each part folds its own accumulator (for the online softmax: running max, sum and
output, which finalize to a part's ``(o, lse)``), and the parts' states are merged by the accumulator's
``combine`` (the log-sum-exp merge, :func:`merge_parts`).

It is the rule ring attention applies across devices (:func:`rewrites.ring`, :func:`rewrites.merge_lse`),
applied across the programs of one kernel: one rule, two levels of the hierarchy, sound for the same reason
(the Fusion Theorem's conditions, :func:`rewrites.streamability`, and an associative ``combine``:
:func:`rewrites.prove_monoid` for the states, :func:`prove_merge` for their ``(o, lse)`` form). Side conditions:
``x`` has a concrete size, is neither tiled nor streamed yet (apply ``split_kv`` first, then ``tile`` and
``stream``: each part is streamed in chunks), and every box removing it has an accumulator; ``0 < n ≤ x``.

The scheduled semantics (:func:`rewrites.execute`) runs each part's stream and merges the states, so
``derive`` verifies the rule as any other (the commuting square on random inputs). One kernel does not
lower it (``lowering.plan`` refuses a tiled axis that a box reduces): the decode entry
(:func:`lowering.decode_attention`) runs the parts as a batch axis of one kernel, each part's diagram with its
log-sum-exp as a second output (:func:`with_lse`), and merges them with :func:`merge_parts`; one part needs no
merge (its merge is the normalisation its finalize did), so there the kernel writes the finished output.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, d = nc.axes("q d")
>>> x = nc.Axis("x", 40)
>>> split = derive(nc.library.attention(q, x, d), split_kv(x, 4), tile(q, 4), stream(x, 4), seed=0)
>>> print(split.diagram.cod), [str(s.rule) for s in split.steps]
q/4×d
(None, ['original', 'split_kv(x, 4)', 'tile(q, 4)', 'stream(x, 4)'])
>>> all(s.verification.passed for s in split.steps[1:]), str(split.diagram.dom.inside[1].axes[0])
(True, 'x/10~4')
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax.numpy as jnp
import sympy
from jax import lax

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram, Ty
from napkin_cat.dtypes import f32
from napkin_cat.hardware import Hardware
from rewrites._proofs import Proof
from rewrites._rule import AxisRule, RewriteError, axis_names, positive_size, relabel_axis
from rewrites._stream import fuse_softmax, streamability


@dataclass(frozen=True, repr=False)
class split_kv(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """Split the reduced axis ``axis`` into ``n`` parts across the grid, merged by the accumulators' ``combine``.

    >>> split_kv("x", 4)
    split_kv(x, 4)
    >>> split_kv("x", 0)
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: split_kv(x, 0): axis 'x': number of parts must be a positive integer, got 0
    """

    n: int = 2

    def __post_init__(self):
        object.__setattr__(self, "n", positive_size(repr(self), "number of parts", self.n, self.name))

    def apply(self, d: Diagram) -> Diagram:
        """The diagram with ``axis`` in parts of ``⌈axis/n⌉``; refused where a side condition fails.

        >>> import napkin_cat as nc
        >>> q, x, d = nc.axes("q x d")
        >>> split_kv(x, 4)(nc.library.attention(q, x, d))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rewrites._rule.RewriteError: split_kv(x, 4): axis 'x': the size of x is symbolic; ...
        >>> split_kv(q, 2)(nc.library.attention(nc.Axis("q", 8), x, d))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rewrites._rule.RewriteError: split_kv(q, 2): axis 'q': no box removes q: ... use tile(q, g)
        """
        x = self.name
        if x not in axis_names(d):
            raise self.fail(f"no wire has axis {x}; axes here: {', '.join(sorted(axis_names(d)))}", axis=x)
        labelled = [a for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.name == x]
        if any(w.has(x) for w in d.cod.inside):
            raise self.fail(
                f"no box removes {x}: an output keeps it, so its groups need no merge; use tile({x}, g)", axis=x
            )
        if any(a.group is not None or a.stream is not None for a in labelled):
            raise self.fail(f"{x} is already tiled or streamed; apply split_kv first, then tile and stream", axis=x)
        size = labelled[0].size
        if not size.is_number:
            raise self.fail(
                f"the size of {x} is symbolic; the parts' length ⌈{x}/{self.n}⌉ needs it: give the axis a size, "
                f"e.g. nc.Axis('{x}', 4096)",
                axis=x,
            )
        if self.n > size:
            raise self.fail(f"{self.n} parts exceed the axis size {size}", axis=x)
        fused = fuse_softmax(x)(d)
        streamability(fused, x, repr(self))  # each part folds the accumulators of the boxes removing x
        return relabel_axis(fused, x, lambda a: a.tiled(math.ceil(int(size) / self.n)))


def choose_parts(programs: int, keys: int, hardware: Hardware, *, chunk: int = 64) -> int:
    """The number of parts ``n`` for split-KV: enough programs to fill the SMs, ``⌈SMs / programs⌉`` (``programs``:
    the grid without the split, batch × key/value heads), no more than the keys hold chunks of ``chunk``.

    >>> from napkin_cat.hardware import H100
    >>> choose_parts(1 * 8, 32768, H100), choose_parts(64 * 8, 32768, H100), choose_parts(8, 100, H100)
    (17, 1, 2)
    """
    return max(1, min(math.ceil(hardware.sms / max(programs, 1)), math.ceil(keys / chunk)))


def with_lse(d: Diagram, axis: str, partial: bool = True) -> Diagram:
    """``d`` whose softmax·contract over ``axis`` also outputs its log-sum-exp: one part's ``(o, lse)``, both f32
    where ``partial`` (the partial results :func:`merge_parts` merges; a row that saw no key has ``o = 0`` and
    ``lse = +∞``), else ``o`` in its own dtype: the keys in one part, ``(o, lse)`` is already the finished result.

    >>> import napkin_cat as nc
    >>> from rewrites import stream
    >>> q, x, d = nc.axes("q x d")
    >>> streamed = stream(x, 16)(nc.library.attention(q, x, d, dtype=nc.bf16))
    >>> print(with_lse(streamed, "x").cod)
    q×d ⊗ q
    >>> [str(w.dtype) for w in with_lse(streamed, "x").cod.inside]   # a part's partial results, merged after
    ['f32', 'f32']
    >>> [str(w.dtype) for w in with_lse(streamed, "x", partial=False).cod.inside]   # one part: the output
    ['bf16', 'f32']
    """
    t = Tape()
    xs = [t.input(a, "x") for a in d.dom.inside]

    def step(i, box, ins):
        if isinstance(box, g.SoftmaxContract) and box.params["axis"] == axis and len(box.cod) == 1:
            scores = box.dom.inside[0]
            stat = scores.with_(axes=[a for a in scores.axes if a.name != axis], dtype=f32)
            both = Ty(box.out.with_(dtype=f32) if partial else box.out, stat)
            return list(t.apply(g.SoftmaxContract(box.name, box.dom, both, data=box.data), *ins))
        return list(t.apply(box, *ins))

    return t.diagram(d.dataflow(xs, step))


def merge_parts(o, lse, part: int, rows: int | None = None):
    """The parts' partial results ``o`` (f32) and ``lse`` merged along their axis ``part`` (``rows``: ``o``'s
    axes past ``lse``'s, broadcast; default 1): the n-ary log-sum-exp merge, ``o = Σ_p e^{L_p} o_p / Σ_p e^{L_p}``,
    ``L = log Σ_p e^{L_p}``, as one reduction of the pairwise merge :func:`prove_merge` proves associative, each
    pair shifted by its larger ``L`` so nothing overflows. A part that saw no key (``lse = ±∞`` with ``o = 0``)
    weighs 0; a row no part saw gives ``o = 0``, ``L = −∞``.

    >>> o, l = merge_parts(jnp.array([[1.0, 1.0], [3.0, 3.0]]), jnp.array([0.0, 0.0]), 0)
    >>> o.tolist(), round(float(l), 4)
    ([2.0, 2.0], 0.6931)
    """

    def pair(a, b):
        (la, oa), (lb, ob) = a, b
        m = jnp.maximum(la, lb)
        shift = jnp.where(jnp.isfinite(m), m, 0.0)
        wa, wb = jnp.exp(la - shift), jnp.exp(lb - shift)
        total = wa + wb
        merged = jnp.where(total > 0, (wa * oa + wb * ob) / jnp.where(total > 0, total, 1.0), 0.0)
        return jnp.where(total > 0, shift + jnp.log(total), -jnp.inf), merged

    rows = 1 if rows is None else rows
    lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)  # an empty part's lse may be +∞ (its sum 0 inverted)
    wide = jnp.broadcast_to(lse.reshape(lse.shape + (1,) * rows), o.shape)
    total, out = lax.reduce((wide, o), (jnp.float32(-jnp.inf), jnp.float32(0)), pair, (part,))
    return out, total[(..., *(0,) * rows)]


def prove_merge(parts: int = 3, keys: int = 2, dim: int = 2) -> Proof:
    """Prove, in sympy, that the ``(o, lse)`` merge is associative and that merging the parts' finalized states
    gives the softmax·contract over all their keys (``parts`` parts of ``keys`` keys, each with a score and a
    value of ``dim`` elements). With :func:`rewrites.prove_monoid` of the state ``combine``, it is why the parts
    may merge in any grouping (a tree of programs, or the n-ary :func:`merge_parts`).

    >>> print(prove_merge())
    proved: merge((o, L)) is associative and merge ∘ finalize = softmax·contract, at parts=3, keys=2, dim=2 \
(6 identities, 1 case)
    """
    if parts < 3:
        raise RewriteError("prove_merge", f"associativity needs 3 parts, got {parts}")
    start = time.perf_counter()
    s = [sympy.symbols(f"s{p}_0:{keys}", real=True) for p in range(parts)]
    v = [[sympy.symbols(f"v{p}_{k}_0:{dim}", real=True) for k in range(keys)] for p in range(parts)]

    def softmax_contract(scores, values):  # (o, L) of a row over these keys
        w = [sympy.exp(x) for x in scores]
        return [sum(a * b[j] for a, b in zip(w, values, strict=True)) / sum(w) for j in range(dim)], sympy.log(sum(w))

    def merge(a, b):  # the combine on finalized states (merge_parts's max shift cancels exactly)
        (oa, la), (ob, lb) = a, b
        wa, wb = sympy.exp(la), sympy.exp(lb)
        return [(wa * x + wb * y) / (wa + wb) for x, y in zip(oa, ob, strict=True)], sympy.log(wa + wb)

    finals = [softmax_contract(s[p], v[p]) for p in range(parts)]
    left, right = merge(merge(finals[0], finals[1]), finals[2]), merge(finals[0], merge(finals[1], finals[2]))
    folded = finals[0]
    for part in finals[1:]:
        folded = merge(folded, part)
    whole = softmax_contract([x for p in s for x in p], [r for p in v for r in p])
    pairs = [(lhs[0][j], rhs[0][j]) for lhs, rhs in ((left, right), (folded, whole)) for j in range(dim)]
    pairs += [(left[1], right[1]), (folded[1], whole[1])]
    for lhs, rhs in pairs:
        if sympy.simplify(sympy.expand_log(lhs - rhs, force=True)) != 0:
            raise RewriteError("prove_merge", f"{lhs} ≠ {rhs}")
    claim = "merge((o, L)) is associative and merge ∘ finalize = softmax·contract"
    sizes = {"parts": parts, "keys": keys, "dim": dim}
    return Proof(claim, sizes, len(pairs), 1, time.perf_counter() - start)
