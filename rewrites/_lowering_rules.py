"""The rewrites a kernel's lowering makes, as rules: verified like ``tile`` and ``stream``, applied by the
lowering through :class:`~rewrites.Rule` (so their side conditions run), and listed as the kernel's steps.

* :class:`~rewrites.fuse_softmax` — ``softmax_x ; [swaps, c·] ; contract_x  →  softmax·contract_x ; c·`` (FAN's
  softmax-contraction lemma, in :mod:`rewrites._stream`: ``stream(x, s)`` applies it first);
* :class:`base2` — ``S = Q·Kᵀ·c ; [masks] ; softmax·contract  →  S = Q·Kᵀ ; [masks] ; softmax₂·contract(c·log₂e)``;
* :class:`tiled_first` — ``S[q, x]  →  S[x, q]`` on the wires holding the streamed axis and a tiled one;
* :class:`pad_neutral` — ``f(X)  →  f(X where a < n else ν)`` for each box ``f`` combining along ``a``, ``ν`` a
  value the side condition checks to be neutral for ``f`` (its image is the unit of the reduction).

The Triton backend lists the rules it applies to a kernel's block diagram as ``kernel.forward.steps``
(``lowering.Lowered.steps``; ``pad_neutral`` joins them at a call whose sizes pad an axis); ``stream(x, s)``
is ``fuse_softmax(x)`` then the relabelling, and a derivation that writes ``fuse_softmax(x)`` shows and
verifies the fusion as its own step. Each is checked per generator by the commuting square
``to_jax ∘ rule = to_jax`` on random inputs
(``tests/test_lowering_rules.py``; for ``pad_neutral`` on inputs padded with random values beyond ``n``):
verification strength (a) of ``docs/user_rewrites.md``. At lowering time only the side conditions run;
``pad_neutral``'s evaluates each box on a one-element padding (a few scalars, one small program per box).

>>> import napkin_cat as nc
>>> from rewrites import fuse_softmax
>>> q, x, d = nc.axes("q x d")
>>> fused = fuse_softmax(x)(nc.library.attention(q, x, d))
>>> [b.name for b in base2()(fused).boxes]
['q d, x d → q x', 'softmax·contract x']
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Diagram, Ty, is_structural
from napkin_cat.generators import Context, IndexMap, Softmax, fname
from napkin_cat.semantics import bind, run
from rewrites._rule import RewriteError, Rule, axis_names
from rewrites._verify import FAST_COMPILE, relative_error, tolerance

LOG2E = math.log2(math.e)
#: the padding values tried, after the box's own, when that one is not neutral for it
CANDIDATES = (0.0, -math.inf, math.inf)


@dataclass(frozen=True)
class base2(Rule):  # noqa: N801 - rules are named as verbs, like functions
    """Have each box with a base-2 form (``in_base2``: a softmax·contract) exponentiate with exp2.

    Where its probabilities meet a 16-bit value (attention's P·V), the box takes a positive scale of its scores,
    log₂e in it: the scale of the box feeding it, where that is positive, moves into it whole.

    rewrite: S = Q·Kᵀ·c ; [masks] ; softmax·contract  →  S = Q·Kᵀ ; [masks] ; softmax₂·contract(c·log₂e)
    for c > 0; any other scores (a score modifier's, a scale of unknown sign) ; softmax·contract  →  … ;
    softmax₂·contract(log₂e).

    Side conditions (each choosing the form, none refusing): the scale moves only where it is positive
    (``max(k·s) = k·max(s)`` for k > 0), only through boxes that commute with it (``passes_base``: masks send
    scores to −∞ at any positive scale), from a box that carries it (``unscaled``): a score modifier reads the
    scale it was written for. Sound because softmax(s) = softmax₂(k·s) for the box's k = c·log₂e; the box then
    takes ``exp₂(s·k − m·k)``, one fused multiply-add a score (FlashAttention-3's form).

    In f32 (cross-entropy's logits) the product ``m·k`` rounds by f32's eps·|m·k|, an error in every exponent
    that 16-bit probabilities hide but f32 ones do not; there ``s − m`` stays exact, and log₂e folds into the
    scale of the box feeding the softmax where it carries one (``scaled``):
    S = Q·Kᵀ·(c·log₂e) ; [masks] ; softmax₂·contract.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax
    >>> q, x, d = nc.axes("q x d")
    >>> fused = base2()(fuse_softmax(x)(nc.library.attention(q, x, d, causal=True, dtype="bf16")))
    >>> [(b.params.get("scale") == LOG2E / sympy.sqrt(d.size), b.params.get("base")) for b in fused.boxes]
    [(False, None), (False, None), (True, 2)]
    >>> capped = base2()(fuse_softmax(x)(nc.library.softcap_attention(q, x, d, cap=30, dtype="bf16")))
    >>> capped.boxes[0].params["scale"], capped.boxes[-1].params["scale"] == LOG2E  # the score modifier between
    (1/sqrt(d), True)
    >>> exact = base2()(fuse_softmax(x)(nc.library.attention(q, x, d, causal=True)))  # f32
    >>> [(b.params.get("scale") == LOG2E / sympy.sqrt(d.size), b.params.get("base")) for b in exact.boxes]
    [(True, None), (False, None), (False, 2)]
    """

    def __repr__(self):
        return "base2()"

    def apply(self, d: Diagram) -> Diagram:
        layers = list(d.inside)
        for j, (left, box, right) in enumerate(d.inside):
            folded = None if is_structural(box) else box.in_base2()
            if folded is None:
                continue
            i, _ = d.producer(j, len(left))
            while i is not None and not is_structural(d.inside[i][1]) and d.inside[i][1].passes_base():
                i, _ = d.producer(i, len(d.inside[i][0]))
            producer = None if i is None or is_structural(d.inside[i][1]) else d.inside[i][1]
            if box.dom.inside[-1].dtype.bits > 16:  # f32 probabilities: the exponent s − m stays exact
                if producer is not None and (scaled := producer.scaled(LOG2E)) is not None:
                    layers[i] = (d.inside[i][0], scaled, d.inside[i][2])
                    layers[j] = (left, folded, right)
                continue
            moved = None if producer is None else producer.unscaled()
            if moved is not None and sympy.sympify(moved[1]).is_positive:  # the max commutes with a positive scale
                layers[i] = (d.inside[i][0], moved[0], d.inside[i][2])
                layers[j] = (left, box.in_base2(scale=moved[1] * LOG2E), right)
            else:
                layers[j] = (left, box.in_base2(scale=LOG2E), right)
        return d.with_layers(layers)


@dataclass(frozen=True)
class tiled_first(Rule):  # noqa: N801
    """Lay out each wire that holds the streamed axis ``axis`` and one of the tiled axes ``tiles`` tiled axes first.

    rewrite: S[q, x] → S[x, q] on the wires inside a kernel tiling ``x`` and streaming ``q``.

    Side conditions: ``axis`` is on some wire; where an output holds both (its block layout is the caller's),
    or an input does unless ``inputs`` (the kernel then transposes that input's block as it loads it), the
    diagram is left as it is. Sound because axes are named and every box reads its wires by name (a
    relabelling of layouts, not of values). The dK, dV kernel then computes ``Sᵀ = K·Q_cᵀ`` and accumulates
    ``Pᵀ·dO`` and ``dSᵀ·Q`` with the block it holds as the left operand, never transposing a computed block
    (FlashAttention-2's Triton kernels do the same).

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> S = nc.Array(q, x)
    >>> exp_sum = nc.exp(S) >> nc.reduce_sum(S, q)
    >>> [str(tiled_first("q", ("x",), inputs=i)(exp_sum).boxes[0].cod) for i in (False, True)]
    ['q×x', 'x×q']
    """

    axis: str
    tiles: tuple = ()
    inputs: bool = False

    def __repr__(self):
        return f"tiled_first({self.axis}, {tuple(self.tiles)}{', inputs=True' if self.inputs else ''})"

    def apply(self, d: Diagram) -> Diagram:
        x = self.axis
        if x not in axis_names(d):
            raise self.fail(f"no wire has axis {x}; axes here: {', '.join(sorted(axis_names(d)))}", axis=x)

        def both(w) -> bool:
            return w.has(x) and any(w.has(a) for a in self.tiles)

        if any(both(w) for w in (*(() if self.inputs else d.dom.inside), *d.cod.inside)):
            return d

        def reorder(w):
            return w.with_(axes=sorted(w.axes, key=lambda a: a.name not in self.tiles)) if both(w) else w

        return d.map_arrays(reorder)


@dataclass(frozen=True)
class Neutral:
    """The value unchanged inside the axis's true extent, ``pad`` beyond it (in the padding).

    >>> Neutral("d", 2, 0.0)(jnp.ones(3), d=jnp.arange(3)).tolist()
    [1.0, 1.0, 0.0]
    """

    axis: str
    extent: int
    pad: float

    def __call__(self, v, **idx):
        return jnp.where(idx[self.axis] < self.extent, v, jnp.asarray(self.pad, v.dtype))

    @property
    def __signature__(self):
        kw = inspect.Parameter.KEYWORD_ONLY
        return inspect.Signature(
            [inspect.Parameter("v", inspect.Parameter.POSITIONAL_ONLY)] + [inspect.Parameter(self.axis, kw)]
        )

    @property
    def __name__(self):
        return f"pad {self.axis} ≥ {self.extent} with {self.pad}"


def _declared(box, axis: str) -> tuple | None:
    """The padding the box declares for its inputs along ``axis``: 0 for a contraction, its accumulator's
    ``padding`` (−∞ for a max or a softmax's scores), −∞ for a softmax; else None."""
    acc = box.accumulator(axis) if axis in box.reduced else None
    if box.contracts and axis in box.reduced:
        return (0.0,) * len(box.dom)
    if acc is not None and len(acc.padding) == len(box.dom):
        return tuple(acc.padding)
    if isinstance(box, Softmax):
        return (-math.inf,)
    return None


def _off_trace(fn, *args):
    """``fn(*args)`` in a thread of its own, where no caller's trace is active (JAX's trace state is per thread):
    the probes compute on concrete numbers also where a kernel, a jit or a shard_map is being traced."""
    def on_cpu(*args):  # tiny arrays: the host compiles them fastest, and a GPU's memory is left alone
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return fn(*args)

    with ThreadPoolExecutor(1) as worker:
        return worker.submit(on_cpu, *args).result()


def _plain(box):
    """``box`` with symbolic, unlabelled axes: what a probe evaluates, and the key its result is cached by (the same
    generator at other sizes or partitions, in the forward or a backward kernel, pads alike)."""
    return _unlabelled(box).boxes[0]


def _unlabelled(box) -> Diagram:
    return box.map_arrays(lambda w: w.with_(axes=[Axis(a.name) for a in w.axes]))


def _probe(box, axis: str, candidates: tuple) -> tuple | None:
    """The first of ``candidates`` (paddings, one value per input) that leaves ``box``'s outputs (restricted to the
    true extent) unchanged when its inputs are padded along ``axis`` with it, or None: the box evaluated on random
    inputs of 2 elements along each axis, and again with a third along ``axis``, the padding, appended, its sizes
    bound to the true extent as a kernel binds them."""
    return _off_trace(_first_neutral, box, axis, candidates)


def _first_neutral(box, axis: str, candidates: tuple) -> tuple | None:
    plain = _unlabelled(box)  # symbolic, unlabelled
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal([2] * len(w.axes), np.float32).astype(w.dtype.jnp) for w in box.dom.inside]
    ctx = Context(sizes=bind(plain.dom, xs))

    def both(xs, pads):
        padded = []
        for v, w, pad in zip(xs, box.dom.inside, pads, strict=True):
            if w.has(axis):
                i = w.names.index(axis)
                v = jnp.concatenate([v, jnp.full([1 if k == i else 2 for k in range(v.ndim)], pad, v.dtype)], axis=i)
            padded.append(v)
        return run(plain, list(xs), ctx), run(plain, padded, ctx)

    # one program, the paddings its arguments: compiled once per box, not once per operation and padding
    evaluate = jax.jit(both, compiler_options=FAST_COMPILE)
    tol = tolerance(box)
    for pads in candidates:
        with jax.ensure_compile_time_eval():  # concrete numbers where the thread itself traces
            want, got = evaluate(xs, [_filler(p, w.dtype.jnp) for p, w in zip(pads, box.dom.inside, strict=True)])
        if all(_unchanged(w, g, wire, axis, tol) for w, g, wire in zip(want, got, box.cod.inside, strict=True)):
            return pads
    return None


def _filler(pad: float, dtype):
    """``pad`` as the probe's argument, converted as ``jnp.full`` converts a Python number: to a float type on the
    host, to any other inside the program (XLA's saturating conversion: +∞ is an integer type's largest value).

    >>> _filler(-math.inf, jnp.bfloat16).dtype, _filler(math.inf, jnp.int32)
    (dtype(bfloat16), inf)
    """
    return np.asarray(pad, dtype) if jnp.issubdtype(dtype, jnp.inexact) else pad


def _unchanged(want, got, wire, axis: str, tol: float) -> bool:
    """Whether the padded evaluation's output ``got``, restricted to the true extent, is ``want``'s within ``tol``."""
    got = np.asarray(got, np.float64)
    if wire.has(axis):
        got = np.take(got, [0, 1], axis=wire.names.index(axis))
    return relative_error(got, want) <= tol  # NaN compares False


def _report(box, pads: tuple) -> str:
    """The box's functions (callable parameters) at the padding of its first input, for messages."""
    found = []
    for k, f in box.params.items():
        if callable(f) and k != "fn":
            value = _off_trace(lambda f: float(np.asarray(f(jnp.float32(pads[0])))), f)
            found.append(f"{k} = {fname(f)} gives {k}({pads[0]}) = {value}")
    return "; ".join(found)


@functools.lru_cache(maxsize=256)
def _neutral(box, axis: str) -> tuple[tuple | None, tuple | None]:
    """The first padding neutral for ``box`` along ``axis`` (its own, then each mix of :data:`CANDIDATES`), and
    the box's own padding (None where it has none)."""
    declared = _declared(box, axis)
    first = [declared] if declared is not None else []
    per_input = [tuple(dict.fromkeys(((declared[k],) if declared else ()) + CANDIDATES)) for k in range(len(box.dom))]
    return _probe(box, axis, tuple(dict.fromkeys((*first, *itertools.product(*per_input))))), declared


def neutral_padding(d: Diagram, axis: str, rule: str = "pad_neutral") -> dict:
    """Per layer of a box combining elements along ``axis``, the values its inputs hold in padding along
    ``axis`` so that they contribute nothing: the box's own (0 for a sum or a contraction, −∞ for a max or a
    softmax's scores) where evaluating the box on it shows it neutral, else the first of 0, −∞, +∞ (per input)
    that is; a :class:`~rewrites.RewriteError` naming the box, its functions' values and the fix where none is.

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> neutral_padding(nc.library.rms_norm(n, d), "d")
    {2: (0.0,)}
    >>> S, V, O = nc.Array(n, d), nc.Array(d), nc.Array(n)
    >>> print(neutral_padding(nc.normalised_contract(S, V, d, O, a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt), "d"))
    {0: (-inf, 0.0)}
    >>> print(neutral_padding(nc.normalised_contract(S, V, d, O, a1=jnp.negative, a2=jnp.abs, b=jnp.sqrt), "d"))
    {0: (0.0, 0.0)}
    >>> signed = nc.normalised_contract(S, V, d, O, a1=jnp.negative, a2=jnp.exp, b=jnp.sqrt)
    >>> neutral_padding(signed, "d")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: pad_neutral: box 'normalised·contract d', axis 'd': padding its inputs with \
(-inf, 0.0) changes its result along d (a1 = negative gives a1(-inf) = inf; a2 = exp gives a2(-inf) = 0.0; ...
    """
    pads = {}
    for i, (_, box, _) in enumerate(d.inside):
        if is_structural(box) or axis not in box.mixes:
            continue
        try:
            found, declared = _neutral(_plain(box), axis)
        except TypeError:  # a box with unhashable parameters: probed uncached
            found, declared = _neutral.__wrapped__(_plain(box), axis)
        if found is None:
            own = f"with {declared}" if declared is not None else "(it declares no padding value)"
            raise _refusal(rule, box, axis, own, declared)
        pads[i] = found
    return pads


def _refusal(rule: str, box, axis: str, own: str, declared) -> RewriteError:
    values = _report(box, declared) if declared is not None else ""
    return RewriteError(
        rule,
        f"padding its inputs {own} changes its result along {axis}{f' ({values})' if values else ''}, and no "
        f"padding of 0, -inf, inf per input leaves it unchanged; choose sizes that {axis}'s blocks divide (no "
        f"ragged tile or chunk, an axis kept whole a power of two ≥ 16), so nothing is padded, or functions that "
        "send one padding value to the unit of the reduction",
        box=box.name,
        axis=axis,
    )


@dataclass(frozen=True)
class pad_neutral(Rule):  # noqa: N801
    """Set each input of a box combining along ``axis`` to a neutral value beyond ``extent``.

    rewrite: f(X) → f(X where index < extent else ν_f)

    Side condition: for each box ``f`` combining elements along ``axis``, padding its inputs with ``ν_f`` leaves
    its result on the true extent unchanged (:func:`neutral_padding` evaluates ``f`` on a padded element: the
    padding's image must be the unit of the reduction, so a normalised contraction with ``a₁ = id``,
    ``a₂ = |·|`` pads its scores with 0, where ``−∞`` would give ``−∞·0`` and ``|−∞|``). Sound because the
    padded elements then contribute nothing, whatever earlier boxes left there; the kernel's ragged last chunk
    of a streamed axis is padded with the same values, chunk by chunk.

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> [b.name for b in pad_neutral("d", 3)(nc.library.rms_norm(n, d)).boxes][2:4]
    ['pad d ≥ 3 with 0.0', 'sum d']
    """

    axis: str
    extent: int

    def __repr__(self):
        return f"pad_neutral({self.axis}, {self.extent})"

    def check(self, d: Diagram) -> dict:
        """The side condition alone: the padding of each box combining along the axis, by layer (see
        :func:`neutral_padding`), or the :class:`~rewrites.RewriteError` naming the box that has none.

        >>> import napkin_cat as nc
        >>> n, d = nc.axes("n d")
        >>> pad_neutral("d", 3).check(nc.library.rms_norm(n, d))
        {2: (0.0,)}
        """
        return neutral_padding(d, self.axis, repr(self))

    def apply(self, d: Diagram) -> Diagram:
        pads = self.check(d)
        layers = []
        for i, (left, box, right) in enumerate(d.inside):
            for k, pad in enumerate(pads.get(i, ())):
                wire = box.dom.inside[k]
                if wire.has(self.axis):
                    keep = Neutral(self.axis, self.extent, pad)
                    fix = IndexMap(keep.__name__, Ty(wire), Ty(wire), data=(("fn", keep),))
                    layers.append((left @ Ty(*box.dom.inside[:k]), fix, Ty(*box.dom.inside[k + 1 :]) @ right))
            layers.append((left, box, right))
        return d.with_layers(layers)
