"""Affine masks found in the functions users write: a mask given as a Python function of its indices is
evaluated once on symbolic indices; where it is a Boolean combination of linear inequalities it becomes the
equal :class:`~napkin_cat.library.Affine`, whose blocks a kernel skips or runs unmasked.

The symbolic indices are linear forms ``Σ cₐ·a + c₀`` with rational coefficients (captured Python or NumPy
numbers are constants). Comparing two gives a formula over integer points: ``a < b`` is ``b − a − 1 ≥ 0``
once scaled to integer coefficients, ``==`` two inequalities, ``!=`` two regions; ``&``, ``|``, ``^`` and ``~``
combine formulas, kept in disjunctive normal form (``~`` pushed inward by De Morgan); ``abs`` of a linear
form may be compared (``abs(q − x) <= W`` is ``−W ≤ q − x ≤ W``). Anything else (a product of two indices,
``//``, ``%``, a ``jnp`` function, ``if`` or ``and`` on a condition) stops the evaluation, and the mask stays
as written: masked element by element, correct and unskipped. sympy's symbols are not
used: their ``==`` is structural equality, a Python bool, so ``q == x`` would read as ``False``.

A conversion is checked before it is used: the function and the :class:`Affine` must agree on random integer
points, many of them on and beside each inequality's boundary; where they do not, the mask stays as written.

>>> window = as_affine(lambda q, x: (x <= q) & (q - x < 4))
>>> window.regions
((((('q', -1), ('x', 1)), 3), ((('q', 1), ('x', -1)), 0)),)
>>> window(q=5, x=2), window(q=5, x=1), window.name
(True, False, '<lambda>')
>>> as_affine(lambda q, x: (q - x) % 4 == 0) is None  # striped: not a finite union of polygons
True
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from napkin_cat.generators import fname, index_names
from napkin_cat.library import Affine

#: the most regions a found mask may have (each is tested per block), and the largest integer coefficient
#: (block bounds are int32: a coefficient times a sequence length must stay inside it)
MAX_REGIONS, MAX_COEFFICIENT, MAX_CONSTANT = 16, 256, 1 << 24


class _NotAffine(TypeError):
    """The symbolic evaluation met something that is not a linear inequality."""


def _number(v) -> Fraction:
    """A captured constant as an exact rational: Python and NumPy numbers, 0-d arrays; never a bool."""
    if isinstance(v, Fraction):
        return v
    a = np.asarray(v)
    if a.ndim or a.dtype.kind not in "iuf" or not np.isfinite(a):
        raise _NotAffine(f"{v!r} is not a number")
    return Fraction(a.item())


class _Linear:
    """``Σ cₐ·a + c₀``, an index as the symbolic evaluation sees it: linear arithmetic, comparisons."""

    __array_ufunc__ = None  # NumPy numbers defer to the reflected operators below
    __hash__ = None

    def __init__(self, coefficients: dict, constant: Fraction = Fraction(0)):
        self.coefficients = {a: c for a, c in coefficients.items() if c}
        self.constant = constant

    @staticmethod
    def of(v) -> _Linear:
        return v if isinstance(v, _Linear) else _Linear({}, _number(v))

    def __add__(self, other):
        o = _Linear.of(other)
        keys = dict.fromkeys([*self.coefficients, *o.coefficients])
        terms = {a: self.coefficients.get(a, 0) + o.coefficients.get(a, 0) for a in keys}
        return _Linear(terms, self.constant + o.constant)

    def __mul__(self, other):
        if isinstance(other, _Linear) and other.coefficients:
            if self.coefficients:
                raise _NotAffine("a product of two indices")
            return other * self.constant
        k = _number(other.constant if isinstance(other, _Linear) else other)
        return _Linear({a: c * k for a, c in self.coefficients.items()}, self.constant * k)

    def __truediv__(self, other):
        k = _number(other.constant if isinstance(other, _Linear) and not other.coefficients else other)
        return self * (1 / k)

    def __neg__(self):
        return self * -1

    def __pos__(self):
        return self

    def __sub__(self, other):
        return self + -_Linear.of(other)

    def __rsub__(self, other):
        return _Linear.of(other) - self

    __radd__, __rmul__ = __add__, __mul__

    def __ge__(self, other):
        return NotImplemented if isinstance(other, _Abs) else _Formula.at_least(self - other, strict=False)

    def __gt__(self, other):
        return NotImplemented if isinstance(other, _Abs) else _Formula.at_least(self - other, strict=True)

    def __le__(self, other):
        return NotImplemented if isinstance(other, _Abs) else _Formula.at_least(other - self, strict=False)

    def __lt__(self, other):
        return NotImplemented if isinstance(other, _Abs) else _Formula.at_least(other - self, strict=True)

    def __eq__(self, other):
        return NotImplemented if isinstance(other, _Abs) else (self >= other) & (self <= other)

    def __ne__(self, other):
        return NotImplemented if isinstance(other, _Abs) else (self > other) | (self < other)

    def __abs__(self):
        return _Abs(self)

    def __bool__(self):
        raise _NotAffine("an index used as a truth value")


class _Abs:
    """``|e|`` for a linear ``e``: only compared, ``|e| ≤ r`` being ``−r ≤ e ≤ r`` and ``|e| ≥ r`` being
    ``e ≥ r or e ≤ −r`` (a bidirectional window: ``abs(q_idx − kv_idx) <= W``)."""

    __array_ufunc__ = None
    __hash__ = None

    def __init__(self, e: _Linear):
        self.e = e

    def __le__(self, r):
        return (self.e <= r) & (-self.e <= r)

    def __lt__(self, r):
        return (self.e < r) & (-self.e < r)

    def __ge__(self, r):
        return (self.e >= r) | (-self.e >= r)

    def __gt__(self, r):
        return (self.e > r) | (-self.e > r)

    def __eq__(self, r):
        return (self <= r) & (self >= r)

    def __ne__(self, r):
        return (self < r) | (self > r)

    def __bool__(self):
        raise _NotAffine("an index used as a truth value")


def _simplified(region: tuple) -> tuple | None:
    """A region's inequalities, one per left-hand side (the tightest), sorted; None where it is empty."""
    tightest: dict = {}
    for terms, c0 in region:
        tightest[terms] = min(c0, tightest.get(terms, c0))
    for terms, c0 in tightest.items():
        opposite = tuple((a, -c) for a, c in terms)
        if (not terms and c0 < 0) or (opposite in tightest and c0 + tightest[opposite] < 0):
            return None  # 0 ≥ −c₀ > 0, or −c₀ ≤ t ≤ c₀' < −c₀
    return tuple(sorted((t, c) for t, c in tightest.items() if t))


class _Formula:
    """A Boolean combination of integer inequalities ``Σ cₐ·a + c₀ ≥ 0``, in disjunctive normal form: kept
    where some region's inequalities all hold (``()``: never; ``((),)``: always)."""

    __array_ufunc__ = None
    __hash__ = None

    def __init__(self, regions):
        kept = {r for r in map(_simplified, regions) if r is not None}
        self.regions = ((),) if () in kept else tuple(sorted(kept))
        if len(self.regions) > MAX_REGIONS:
            raise _NotAffine(f"more than {MAX_REGIONS} regions")

    @staticmethod
    def at_least(e: _Linear, *, strict: bool) -> _Formula:
        """``e ≥ 0`` (``e > 0`` when strict) over integer points: scaled to coprime integer coefficients."""
        scale = math.lcm(*(c.denominator for c in (*e.coefficients.values(), e.constant)))
        terms = {a: int(c * scale) for a, c in e.coefficients.items()}
        c0 = int(e.constant * scale) - strict
        g = math.gcd(*terms.values()) or 1
        terms, c0 = tuple(sorted((a, c // g) for a, c in terms.items())), c0 // g  # Σ (c/g)·a ≥ ⌈−c₀/g⌉
        if any(abs(c) > MAX_COEFFICIENT for _, c in terms) or abs(c0) > MAX_CONSTANT:
            raise _NotAffine("a coefficient too large for a kernel's int32 bounds")
        return _Formula((((terms, c0),),))

    @staticmethod
    def of(v) -> _Formula:
        if isinstance(v, _Formula):
            return v
        if isinstance(v, bool | np.bool_):
            return _Formula(((),) if v else ())
        raise _NotAffine(f"{v!r} is not a condition")

    def __and__(self, other):
        return _Formula(a + b for a in self.regions for b in _Formula.of(other).regions)

    def __or__(self, other):
        return _Formula(self.regions + _Formula.of(other).regions)

    def __invert__(self):  # not (R₁ or R₂ …) = (not R₁) and (not R₂) …, not (t + c₀ ≥ 0) = −t − c₀ − 1 ≥ 0
        negated = (_Formula(((tuple((a, -c) for a, c in t), -c0 - 1),) for t, c0 in r) for r in self.regions)
        return functools.reduce(operator.and_, negated, _Formula(((),)))

    def __xor__(self, other):
        other = _Formula.of(other)
        return (self & ~other) | (~self & other)

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def __bool__(self):
        raise _NotAffine("a condition used as a truth value (and, or, if): write &, |, ~")


def _boundary_points(affine: Affine, names: tuple, rng: np.random.Generator, n: int = 512) -> dict:
    """Random integer points, and for every inequality points where it is −1, 0 and +1 (or its nearest
    integers): the points where a strict and a non-strict comparison differ. Non-negative, as indices are."""
    span = 2 * max((abs(c0) for r in affine.regions for _, c0 in r), default=0) + 64
    points = [{a: rng.integers(0, span, n) for a in names}]
    for region in affine.regions:
        for terms, c0 in region:
            for a, c in terms:
                p = {b: rng.integers(0, span, n) for b in names}
                rest = sum((k * p[b] for b, k in terms if b != a), np.full(n, c0))
                for step in (-1, 0, 1):
                    points.append(p | {a: -rest // c + step})
    grid = {a: np.concatenate([p[a] for p in points]) for a in names}
    keep = np.all([grid[a] >= 0 for a in names], axis=0)
    return {a: v[keep] for a, v in grid.items()}


def _agrees(fn: Callable, affine: Affine, names: tuple, seed: int) -> bool:
    """Whether ``fn`` and ``affine`` keep the same points of a random integer grid (:func:`_boundary_points`)."""
    grid = _boundary_points(affine, names, np.random.default_rng(seed))
    try:
        want = np.broadcast_to(np.asarray(fn(**grid), bool), grid[names[0]].shape)
    except Exception:  # noqa: BLE001 - a function that runs on symbols but not on arrays: keep it as written
        return False
    got = np.broadcast_to(np.asarray(affine(**{a: grid[a] for a in affine.axes}), bool), want.shape)
    return bool(np.array_equal(want, got))


def as_affine(fn: Callable, names: tuple[str, ...] | None = None, *, seed: int = 0) -> Affine | None:
    """The :class:`~napkin_cat.library.Affine` equal to the mask ``fn(**indices)`` (true keeps a score),
    named after ``fn``, or None where ``fn`` is not a Boolean combination of linear inequalities in its
    indices (or keeps every point, or none). ``names``: the indices a ``fn`` taking ``**kwargs`` gets. The
    result is checked on random integer points drawn from ``seed``; a disagreement gives None.

    >>> W, P = 128, 16
    >>> print(as_affine(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < W).regions)
    ((((('kv_idx', 1), ('q_idx', -1)), 127),),)
    >>> prefix_lm = as_affine(lambda q, x: (x < P) | (x <= q))
    >>> len(prefix_lm.regions), prefix_lm(q=3, x=10), prefix_lm(q=3, x=20), prefix_lm(q=30, x=20)
    (2, True, False, True)
    >>> as_affine(lambda q, x: q * x < 10), as_affine(lambda q, x: x <= q if q > 2 else True)
    (None, None)
    """
    if isinstance(fn, Affine):
        return fn
    names = index_names(fn, score=False) or names
    if not names:
        return None
    try:
        found = fn(**{a: _Linear({a: Fraction(1)}) for a in names})
        regions = _Formula.of(found).regions
    except Exception:  # noqa: BLE001 - anything the symbols cannot follow leaves the mask as written
        return None
    if regions in ((), ((),)):
        return None
    affine = Affine(regions, fname(fn))
    return affine if _agrees(fn, affine, tuple(names), seed) else None


@dataclass(frozen=True)
class Combined:
    """Masks joined by ``&`` (:func:`and_masks`) or ``|`` (:func:`or_masks`). Where every part takes four
    parameters by position (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``, whatever their names), so does
    the combination, passing its arguments on by position; otherwise each part reads its indices by name and
    the combination takes all of them.

    >>> both = Combined("&", (lambda q, x: x <= q, lambda q, x: q - x < 2))
    >>> [bool(both(q=3, x=x)) for x in range(5)], both.__name__
    ([False, False, True, True, False], 'and_masks(<lambda>, <lambda>)')
    """

    op: str
    parts: tuple

    @property
    def positional(self) -> bool:
        """Whether every part is FlexAttention's ``mask_mod``: four parameters, passed by position."""
        return all(_takes_four(p) for p in self.parts)

    def __call__(self, *args, **indices):
        join = operator.and_ if self.op == "&" else operator.or_
        if self.positional:
            args = tuple(self.__signature__.bind(*args, **indices).arguments.values())
            return functools.reduce(join, (p(*args) for p in self.parts))
        return functools.reduce(join, (p(**_read(p, indices)) for p in self.parts))

    @property
    def __signature__(self):
        if self.positional:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            return inspect.Signature([inspect.Parameter(n, kind) for n in ("b", "h", "q_idx", "kv_idx")])
        names = dict.fromkeys(n for p in self.parts for n in index_names(p, score=False) or ())
        return inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])

    @property
    def __name__(self):
        return f"{'and' if self.op == '&' else 'or'}_masks({', '.join(fname(p) for p in self.parts)})"


def _takes_four(fn: Callable) -> bool:
    """Whether ``fn`` takes exactly four parameters, each passable by position (FlexAttention's mask_mod)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 4 and all(p.kind in kinds for p in params)


def _read(fn: Callable, indices: dict) -> dict:
    names = index_names(fn, score=False)
    return indices if names is None else {n: indices[n] for n in names}


def _combined(op: str, fns: tuple) -> Callable:
    if not fns:
        raise TypeError(f"{'and' if op == '&' else 'or'}_masks needs at least one mask")
    if all(isinstance(f, Affine) for f in fns):
        return functools.reduce(operator.and_ if op == "&" else operator.or_, fns)
    return Combined(op, tuple(fns))


def and_masks(*fns: Callable) -> Callable:
    """The mask keeping what every one of ``fns`` keeps (FlexAttention's ``and_masks``): an
    :class:`~napkin_cat.library.Affine` where they all are; see :class:`Combined`.

    >>> sliding = and_masks(lambda b, h, q, kv: kv <= q, lambda b, h, q, kv: q - kv < 4)
    >>> as_affine(sliding)(q_idx=9, kv_idx=5), as_affine(sliding)(q_idx=9, kv_idx=6)
    (False, True)
    >>> and_masks(Affine.causal("q", "x"), Affine.at_least(2, q=-1, x=1)).name
    'causal(q ≥ x) ∧ -1·q + 1·x + 2 ≥ 0'
    """
    return _combined("&", fns)


def or_masks(*fns: Callable) -> Callable:
    """The mask keeping what any one of ``fns`` keeps (FlexAttention's ``or_masks``): an
    :class:`~napkin_cat.library.Affine` where they all are; see :class:`Combined`.

    >>> prefix_lm = or_masks(lambda q, x: x <= q, lambda x: x < 8)
    >>> list(inspect.signature(prefix_lm).parameters), bool(prefix_lm(q=2, x=5)), len(as_affine(prefix_lm).regions)
    (['q', 'x'], True, 2)
    """
    return _combined("|", fns)
