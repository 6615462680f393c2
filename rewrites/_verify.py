"""Verification of rewrites on random inputs: the commuting square ``execute ∘ rule = to_jax``.

Symbolic sizes are bound to random integers chosen so that tiles and streams are ragged (sizes that
the group and stream sizes do not divide) and several groups and chunks run, within a budget of
elements per wire; inputs are fresh random normals in each wire's dtype. Both sides run under
``jax.jit``: the scheduled interpreter's Python loops over groups and chunks trace once per block shape,
so a check costs one compilation, not thousands of dispatches. Sizes too large to verify are refused
before anything is allocated.

Tolerances depend on the precision the check computes in: the lowest-precision wire, or the format
the matmuls round f32 operands to, whichever is coarser. Both sides of a rewrite's check run their
matmuls at ``"highest"`` precision (:data:`PRECISION`): at a GPU's default, f32 matmuls round their
operands to TF32 (Hopper, Ampere) and the two sides, associating differently, differ by that rounding,
not by the rewrite. A lowered kernel runs at the precision its user gets, so its check takes the
tolerance of the format its matmuls round to (:func:`matmul_format`). The record names the format
that set its tolerance.

>>> import napkin_cat as nc
>>> from rewrites import tile, stream
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> record = check(attn, stream(x, 8)(tile(q, 4)(attn)), seed=0)
>>> record.passed, record.seed
(True, 0)
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin_cat.diagram import Array, Diagram
from napkin_cat.dtypes import bf16, f16, f32, fp8_e4m3, fp8_e5m2
from napkin_cat.semantics import to_jax
from rewrites._rule import RewriteError, positive_size
from rewrites._schedule import execute, partitions

#: relative tolerance by the lowest-precision dtype on the diagram's wires
TOLERANCE = {f32: 1e-4, f16: 5e-3, bf16: 3e-2, fp8_e4m3: 1.5e-1, fp8_e5m2: 2.5e-1}
#: the matmul precision a rewrite's check runs both sides at (``jax.default_matmul_precision``)
PRECISION = "highest"
#: what f32 matmul operands round to on a GPU, by ``jax_default_matmul_precision`` (None: the default);
#: a setting not named here is taken as the coarsest, bf16
GPU_MATMULS = {
    None: "tf32", "default": "tf32", "high": "tf32", "tensorfloat32": "tf32", "TF32_TF32_F32": "tf32",
    "highest": "f32", "float32": "f32", "F32_F32_F32": "f32", "TF32_TF32_F32_X3": "f32",
    "BF16_BF16_F32_X6": "f32", "BF16_BF16_F32_X9": "f32", "bfloat16": "bf16", "BF16_BF16_F32": "bf16",
}  # fmt: skip
#: a matmul format's tolerance: that of the dtype with its significand (TF32 keeps f16's 10 bits)
FORMATS = {"f32": f32, "tf32": f16, "bf16": bf16}
#: the most elements any wire may hold in a verification (16 MiB in f32); larger sizes are refused
MAX_ELEMENTS = 2**22
#: the elements per wire that randomly drawn sizes aim for (they shrink the unpartitioned axes to fit)
SAMPLE_ELEMENTS = 2**18


@dataclass(frozen=True)
class Verification:
    """The record of one check: sizes used, error found, tolerance, outcome, time, seed, and the precision
    the tolerance is that of (``basis``, see :func:`bound`).

    >>> print(Verification({"q": 5}, 1.8, 1e-4, False, 0.1, 7, "f32"))
    FAILED: max rel. error 1.8e+00 > tolerance 1e-04 (f32) at q=5 (seed 7)
    """

    sizes: dict
    max_error: float
    tolerance: float
    passed: bool
    seconds: float
    seed: int
    basis: str = "f32"

    def __str__(self):
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        verdict, relation = ("verified", "≤") if self.passed else ("FAILED", ">")
        return (
            f"{verdict}: max rel. error {self.max_error:.1e} {relation} tolerance {self.tolerance:.0e} "
            f"({self.basis}) at {sizes} (seed {self.seed})"
        )


def matmul_format(platform: str | None = None) -> str:
    """What f32 matmul operands round to at the current ``jax_default_matmul_precision`` on ``platform``
    (the default backend's if None): ``"f32"``, ``"tf32"`` or ``"bf16"``. CPUs compute f32 matmuls in f32
    whatever the setting; TPUs in bf16 passes unless asked for ``"highest"``.

    >>> with jax.default_matmul_precision("default"):
    ...     matmul_format("cpu"), matmul_format("gpu")
    ('f32', 'tf32')
    >>> with jax.default_matmul_precision("highest"):
    ...     matmul_format("gpu")
    'f32'
    """
    setting = jax.config.jax_default_matmul_precision
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return "f32"
    if platform == "tpu":
        return "f32" if GPU_MATMULS.get(setting) == "f32" else "bf16"
    return GPU_MATMULS.get(setting, "bf16")


def bound(d: Diagram, matmuls: str | None = None) -> tuple[float, str]:
    """``d``'s tolerance and the precision that sets it: its lowest-precision wire's dtype, or
    ``"<format> matmuls"`` where its matmuls (rounding f32 operands to ``matmuls``: ``"f32"``, ``"tf32"`` or
    ``"bf16"``; by default :func:`matmul_format`'s) compute coarser.

    >>> import napkin_cat as nc
    >>> attn = nc.library.attention(*nc.axes("q x d"))
    >>> bound(attn, "f32"), bound(attn, "tf32"), bound(nc.library.attention(*nc.axes("q x d"), dtype="bf16"), "tf32")
    ((0.0001, 'f32'), (0.005, 'tf32 matmuls'), (0.03, 'bf16'))
    """
    matmuls = matmul_format() if matmuls is None else matmuls
    if matmuls not in FORMATS:
        raise RewriteError("verify", f"matmuls must be one of {', '.join(map(repr, FORMATS))}, got {matmuls!r}")
    wire = max([w.dtype for w in _wires(d) if w.dtype in TOLERANCE] or [f32], key=TOLERANCE.__getitem__)
    tol, of_matmuls = TOLERANCE[wire], TOLERANCE[FORMATS[matmuls]]
    return (of_matmuls, f"{matmuls} matmuls") if of_matmuls > tol else (tol, str(wire))


def tolerance(d: Diagram, matmuls: str | None = None) -> float:
    """The tolerance for a diagram: that of its lowest-precision wire, or of the format its matmuls round f32
    operands to, if coarser (see :func:`bound`).

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> tolerance(nc.library.attention(q, x, d)), tolerance(nc.library.attention(q, x, d, dtype=nc.bf16))
    (0.0001, 0.03)
    >>> tolerance(nc.library.attention(q, x, d), matmuls="tf32")
    0.005
    """
    return bound(d, matmuls)[0]


def _wires(d: Diagram) -> list[Array]:
    """Every wire of ``d``: inputs, outputs and each box's outputs."""
    return [*d.dom.inside, *d.cod.inside, *(w for b in d.boxes for w in b.cod.inside)]


def _elements(w: Array, sizes: dict) -> int:
    return math.prod(int(a.size.subs(sizes)) for a in w.axes)


def sample_sizes(d: Diagram, rng: random.Random, *, small: int = 16, budget: int = SAMPLE_ELEMENTS) -> dict:
    """Concrete sizes for ``d``'s symbolic axes: tiled and streamed axes get 2–3 groups/chunks, the last ragged,
    the others 2 to ``small``, halved (largest first) until no wire holds more than ``budget`` elements.

    >>> import napkin_cat as nc
    >>> from rewrites import tile
    >>> b, q, d = nc.axes("b q d")
    >>> sizes = sample_sizes(tile(q, 128)(nc.library.matmul(q, d, b)), random.Random(0), budget=10**4)
    >>> n = sizes[q.size]
    >>> 129 <= n < 384 and n % 128 > 0, max(n * sizes[b.size], n * sizes[d.size]) <= 10**4
    (True, True)
    """
    tiles, streams = partitions(d)
    sizes, free = {}, set()
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            if not isinstance(a.size, sympy.Symbol) or a.size in sizes:
                continue
            unit = max(tiles.get(a.name, 1), streams.get(a.name, 1))
            if unit > 2:  # two or three pieces, the last one ragged
                n = rng.randint(unit + 1, 3 * unit - 1)
                sizes[a.size] = n + (n % unit == 0)
            else:
                sizes[a.size] = rng.randint(2, small)
                free.add(a.size)
    for b in d.boxes:  # a box that needs a power of two there (a Hadamard matrix) gets one; halving keeps it so
        for a in getattr(b, "powers_of_two", ()):
            size = next((x.axis(a).size for x in b.dom.inside if a in x.names), None)
            if size in sizes:
                sizes[size] = 1 << (sizes[size].bit_length() - 1)
    while True:
        widest = max(_wires(d), key=lambda w: _elements(w, sizes))
        shrinkable = [a.size for a in widest.axes if a.size in free and sizes[a.size] > 1]
        if _elements(widest, sizes) <= budget or not shrinkable:
            return sizes
        largest = max(shrinkable, key=sizes.__getitem__)
        sizes[largest] //= 2


def _bind(d: Diagram, sizes: dict | None, rule: str) -> tuple[dict, dict]:
    """Split user ``sizes`` (keyed by axis name or size symbol) into bindings of ``d``'s size symbols and
    new sizes for its concretely sized axes."""
    symbols = {a.name: a.size for w in _wires(d) for a in w.axes}
    bound, resized = {}, {}
    for key, value in (sizes or {}).items():
        name = key.name if isinstance(key, sympy.Symbol) else str(key)
        if name not in symbols:
            raise RewriteError(rule, f"sizes name axis {name}, which no wire has; axes: {', '.join(symbols)}")
        n = positive_size(rule, "a verification size", value, name)
        if isinstance(symbols[name], sympy.Symbol):
            bound[symbols[name]] = n
        elif int(symbols[name]) != n:
            resized[name] = n
    return bound, resized


def _resized(d: Diagram, resized: dict) -> Diagram:
    """``d`` with the concretely sized axes named in ``resized`` given those sizes (labels kept); ``d`` itself where
    they have them already, so that a check finds the program compiled for it (:func:`jitted`, by identity)."""
    if all(a.size == resized[a.name] for w in _wires(d) for a in w.axes if a.name in resized):
        return d
    return d.map_arrays(lambda w: w.with_(axes=[a.resized(resized.get(a.name, a.size)) for a in w.axes]))


def guard(d: Diagram, sizes: dict, rule: str = "verify") -> None:
    """Refuse, before allocating anything, sizes at which some wire of ``d`` would exceed :data:`MAX_ELEMENTS`.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d", q=65536, x=65536, d=64)
    >>> guard(nc.library.attention(q, x, d), {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: verify: box 'q d, x d → q x', axis 'q': verifying at q=65536, x=65536 would hold ...
    """
    for box, w in [(None, w) for w in d.dom.inside] + [(b, w) for b in d.boxes for w in b.cod.inside]:
        n = _elements(w, sizes)
        if n <= MAX_ELEMENTS:
            continue
        largest = max(w.axes, key=lambda a: int(a.size.subs(sizes)))
        at = ", ".join(f"{a.name}={a.size.subs(sizes)}" for a in w.axes)
        raise RewriteError(
            rule,
            f"verifying at {at} would hold {n:,} elements on the wire {w.describe()}, over the "
            f"{MAX_ELEMENTS:,} a verification may use; pass smaller sizes, e.g. sizes={{'{largest.name}': 256}} "
            "(concrete axes are resized for the check), or verify=False",
            box=box.name if box is not None else None,
            axis=largest.name,
        )


def random_inputs(d: Diagram, sizes: dict, seed: int) -> list:
    """Fresh random normal inputs for ``d`` at ``sizes``, one per input wire, in the wires' dtypes
    (drawn by NumPy from ``seed``: nothing to compile).

    >>> import napkin_cat as nc
    >>> a, b, c = nc.axes("a b c")
    >>> sizes = {a.size: 3, b.size: 2, c.size: 4}
    >>> [x.shape for x in random_inputs(nc.library.matmul(a, b, c), sizes, seed=0)]
    [(3, 2), (2, 4)]
    """
    rng = np.random.default_rng(seed)
    shapes = [tuple(int(a.size.subs(sizes)) for a in w.axes) for w in d.dom.inside]
    return [_cast(rng.standard_normal(s, np.float32), w.dtype.jnp) for s, w in zip(shapes, d.dom.inside, strict=True)]


def _cast(x: np.ndarray, dtype) -> jax.Array:
    """``x`` (f32) in ``dtype``: to a float type on the host, bit for bit XLA's rounding (nothing to compile), to
    any other by XLA, whose conversions (saturating, a negative number to an unsigned 0) NumPy's do not all match.

    >>> x = np.random.default_rng(0).standard_normal(1000, np.float32) * 100
    >>> all(np.array_equal(_cast(x, t), jnp.asarray(x).astype(t)) for t in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8))
    True
    """
    return jnp.asarray(x.astype(dtype)) if jnp.issubdtype(dtype, jnp.inexact) else jnp.asarray(x).astype(dtype)


def relative_error(a, b) -> float:
    """The largest absolute difference relative to the largest finite entry of ``b`` (equal infinities agree).

    >>> round(relative_error([1.0, 2.1], [1.0, 2.0]), 6)
    0.05
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not a.size:
        return 0.0
    same = a == b  # equal infinities (masked scores) agree exactly
    diff = np.where(same, 0.0, np.abs(a - b))
    scale = np.max(np.abs(np.where(np.isfinite(b), b, 0.0)), initial=1e-30)
    return float(np.max(diff) / max(scale, 1e-30))


_JITTED: OrderedDict = OrderedDict()
#: XLA options for checks: a verification runs once, so compiling fast beats running fast (4x less time)
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jitted(semantics: Callable[[Diagram], Callable], d: Diagram) -> Callable:
    """``jax.jit(semantics(d))``, cached for the last few diagrams so that a derivation compiles its
    reference once per block shape (``semantics`` is ``to_jax`` or ``execute``).

    >>> import napkin_cat as nc
    >>> attn = nc.library.attention(*nc.axes("q x d"))
    >>> jitted(to_jax, attn) is jitted(to_jax, attn)
    True
    """
    key = (semantics, id(d))
    if key not in _JITTED:
        # the diagram is kept so that its id is not reused while cached
        _JITTED[key] = (d, jax.jit(semantics(d), compiler_options=FAST_COMPILE))
        if len(_JITTED) > 16:
            _JITTED.popitem(last=False)
    _JITTED.move_to_end(key)
    return _JITTED[key][1]


@dataclass(frozen=True)
class Trial:
    """Where checks run: the bound sizes, the seed, the inputs and the reference's outputs on them.

    A derivation draws one trial and checks every step on it, so the reference is compiled and run once.

    >>> import napkin_cat as nc
    >>> from rewrites import tile
    >>> q, x, d = nc.axes("q x d")
    >>> attn = nc.library.attention(q, x, d)
    >>> trial = Trial.draw(attn, attn, seed=1, sizes={"q": 3, "x": 5, "d": 2})
    >>> [a.shape for a in trial.inputs], [w.shape for w in trial.want]
    ([(3, 2), (5, 2), (5, 2)], [(3, 2)])
    >>> trial.check(tile(q, 2)(attn)).passed
    True
    """

    sizes: dict
    resized: dict
    seed: int
    inputs: list
    want: tuple

    @classmethod
    def draw(
        cls,
        reference: Diagram,
        candidate: Diagram,
        *,
        seed: int | None = None,
        sizes: dict | None = None,
        rule: str = "verify",
    ) -> Trial:
        """Bind sizes (``sizes`` by axis name or symbol, the rest drawn from ``seed`` for ``candidate``'s
        partitions), refuse sizes too large to verify, draw the inputs and run the reference (jitted).

        >>> import napkin_cat as nc
        >>> from rewrites import tile
        >>> q, x, d = nc.axes("q x d")
        >>> attn = nc.library.attention(q, x, d)
        >>> trial = Trial.draw(attn, tile(q, 4)(attn), seed=3, sizes={"x": 5})
        >>> trial.sizes["x"], trial.seed, 5 <= trial.sizes["q"] <= 11 and trial.sizes["q"] % 4 > 0
        (5, 3, True)
        """
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        bound, resized = _bind(candidate, sizes, rule)
        reference, candidate = _resized(reference, resized), _resized(candidate, resized)
        bound = {**sample_sizes(candidate, random.Random(seed)), **bound}
        guard(candidate, bound, rule)
        xs = random_inputs(reference, bound, seed)
        with jax.default_matmul_precision(PRECISION):
            want = jitted(to_jax, reference)(*xs)
        named = {**{str(k): v for k, v in bound.items()}, **resized}
        return cls(named, resized, seed, xs, want if isinstance(want, tuple) else (want,))

    def compare(
        self,
        got,
        tol: float,
        seconds: float,
        rule: str,
        what: str = "the rewritten diagram",
        *,
        basis: str = "as given",
    ) -> Verification:
        """The record of ``got`` (the outputs of ``what``) against the reference's; raises :class:`RewriteError`
        if they differ beyond ``tol`` (the tolerance of ``basis``, see :func:`bound`)."""
        got = got if isinstance(got, tuple) else (got,)
        err = max(relative_error(g, w) for g, w in zip(got, self.want, strict=True))
        rec = Verification(self.sizes, err, tol, err <= tol, seconds, self.seed, basis)
        if not rec.passed:
            raise RewriteError(rule, f"{what} differs from the original: {rec}")
        return rec

    def resize(self, d: Diagram) -> Diagram:
        """``d`` with its concretely sized axes at the trial's sizes (where ``sizes`` changed them); ``d`` itself
        where it has them.

        >>> import napkin_cat as nc
        >>> attn = nc.library.attention(*nc.axes("q x d", d=64))
        >>> trial = Trial.draw(attn, attn, seed=0, sizes={"d": 8})
        >>> resized = trial.resize(attn)
        >>> [w.axes[-1].size for w in resized.dom.inside], trial.resize(resized) is resized
        ([8, 8, 8], True)
        """
        return _resized(d, self.resized)

    def program(self, candidate: Diagram):
        """``candidate``'s check (its jitted scheduled semantics at :data:`PRECISION`) traced and lowered for the
        trial's inputs: ``.compile()`` it (in a thread of its own: an XLA compile releases the GIL) and
        :meth:`check` then finds it compiled.

        >>> import napkin_cat as nc
        >>> from rewrites import tile
        >>> q, x, d = nc.axes("q x d")
        >>> attn = nc.library.attention(q, x, d)
        >>> trial = Trial.draw(attn, attn, seed=1, sizes={"q": 5, "x": 3, "d": 2})
        >>> tiled = tile(q, 2)(attn)
        >>> _ = trial.program(tiled).compile()
        >>> trial.check(tiled).passed
        True
        """
        with jax.default_matmul_precision(PRECISION):
            return jitted(execute, self.resize(candidate)).trace(*self.inputs).lower()

    def check(self, candidate: Diagram, rule: str = "verify") -> Verification:
        """Run ``candidate``'s scheduled semantics (jitted) on the trial's inputs and compare, both sides'
        matmuls at :data:`PRECISION` (so the tolerance is that of the wires' dtypes on every platform)."""
        start = time.perf_counter()
        with jax.default_matmul_precision(PRECISION):
            got = jax.block_until_ready(jitted(execute, self.resize(candidate))(*self.inputs))
        tol, basis = bound(candidate, "f32")
        return self.compare(got, tol, time.perf_counter() - start, rule, basis=basis)


def check(
    reference: Diagram, candidate: Diagram, *, seed: int | None = None, sizes: dict | None = None, rule: str = "verify"
) -> Verification:
    """Compare the scheduled semantics of ``candidate`` with the reference semantics of ``reference``.

    ``sizes`` fixes sizes by axis name (or size symbol); the others are drawn from ``seed`` (from the OS if
    None). A concretely sized axis named in ``sizes`` is resized in both diagrams for the check. Raises
    :class:`RewriteError` if they differ beyond the dtype's tolerance (the message gives the sizes and the
    seed that replay it), or if some wire would exceed :data:`MAX_ELEMENTS`.

    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> check(nc.reduce_sum(nc.Array(n), n), nc.reduce_max(nc.Array(n), n), seed=1, sizes={"n": 4})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: verify: ... FAILED: max rel. error 4.1e-01 > tolerance 1e-04 (f32) at n=4 (seed 1)
    """
    return Trial.draw(reference, candidate, seed=seed, sizes=sizes, rule=rule).check(candidate, rule)
