"""Axes: the wires of neural circuit diagrams.

An :class:`Axis` has a name and a size, a sympy expression (a positive integer symbol by default).
It may carry FAN's partition labels: a *group* size ``g`` (tiling, a → (a/g) × g, one group per core),
a *split* of each group over ``w`` warpgroups one level below (a → (a/g) × w × (g/w), drawn ``a/g÷w``)
and a *stream* size ``s`` (streaming, the axis is visited in chunks of ``s``). Relabellings only change
these labels; the size stays the whole axis, ``(a/g)·g``.

>>> q, x, d = axes("q x d")
>>> q
Axis('q')
>>> q.size
q
>>> axes("n d", d=64)[1].size
64
>>> t = q.tiled(128); t.groups, t.local_size
(q/128, 128)
>>> x.streamed(64)
Axis('x', stream=64)
>>> print(q.tiled(256).divided(2))
q/256÷2
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from napkin_cat.errors import AxisError


def _size(name: str, size) -> sympy.Expr:
    """A size symbol assumed a positive integer, or a given size; a number must be a positive integer.

    Floats are refused even when whole (``2.5`` would truncate in evaluation and scale by ``1/√2.5``);
    zero is refused too: an empty axis has nothing to compute. The symbols of a symbolic size are positive
    integers: one without that assumption (``sympy.Symbol("n")``, or ``"n - 5"`` as a string) is read as the
    positive integer symbol of its name, the one ``axes("n")`` makes. A size that is not positive for any
    value of them (``1 - n``) is refused; one positive only for some (``n - 5``, a convolution's
    ``x - k + 1``) is kept, and checked where its symbols are bound (``to_jax``'s arrays).

    >>> _size("q", "n - 5").free_symbols == {sympy.Symbol("n", positive=True, integer=True)}
    True
    >>> _size("q", "1 - n")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: axis 'q': size 1 - n is not positive for any positive integer n; a size must be \
a positive integer, or positive for some values of its symbols (n - 5)
    """
    if size is None:
        return sympy.Symbol(name, positive=True, integer=True)
    if isinstance(size, bool) or isinstance(size, str) and not size.strip():
        raise AxisError(f"axis {name!r}: size must be a positive integer, got {size!r}")
    try:
        value = sympy.sympify(size)
    except (sympy.SympifyError, TypeError) as e:
        raise AxisError(f"axis {name!r}: size must be a positive integer or a sympy expression, got {size!r}") from e
    if not isinstance(value, sympy.Expr):
        raise AxisError(f"axis {name!r}: size must be a positive integer or a sympy expression, got {size!r}")
    if value.is_number and not (value.is_integer and value.is_positive):
        raise AxisError(f"axis {name!r}: size must be a positive integer, got {size!r}")
    value = value.xreplace(
        {s: sympy.Symbol(s.name, positive=True, integer=True) for s in value.free_symbols if not s.is_positive}
    )
    if value.is_positive is False:
        symbols = ", ".join(sorted(map(str, value.free_symbols)))
        raise AxisError(
            f"axis {name!r}: size {value} is not positive for any positive integer {symbols}; a size must be a "
            "positive integer, or positive for some values of its symbols (n - 5)"
        )
    return value


@dataclass(frozen=True, init=False)
class Axis:
    """A named array axis with a sympy size and optional FAN partition labels.

    >>> Axis("d", 64) == Axis("d", 64)
    True
    >>> Axis("d", 64) == Axis("d")
    False
    >>> Axis("d", 2.5)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: axis 'd': size must be a positive integer, got 2.5
    """

    name: str
    size: sympy.Expr
    group: sympy.Expr | None = None
    stream: sympy.Expr | None = None
    split: sympy.Expr | None = None

    def __init__(self, name: str, size=None, *, group=None, stream=None, split=None):
        if not isinstance(name, str) or not name.isidentifier():
            raise AxisError(f"axis name must be an identifier, got {name!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "size", _size(name, size))
        for label, value in (("group", group), ("stream", stream)):
            if value is not None:
                value = sympy.sympify(value)
                if value.is_number and (value <= 0 or not value.is_integer):
                    raise AxisError(f"axis {name!r}: {label} size must be a positive integer, got {value}")
                if value.is_number and self.size.is_number and value > self.size:
                    raise AxisError(f"axis {name!r}: {label} size {value} exceeds the axis size {self.size}")
            object.__setattr__(self, label, value)
        if split is not None:
            split = sympy.sympify(split)
            if self.group is None or not (split.is_integer and split.is_positive):
                raise AxisError(f"axis {name!r}: a split is a positive integer number of parts of a group, got {split}")
            if (self.group / split).is_integer is False:
                raise AxisError(f"axis {name!r}: a group of {self.group} does not split into {split} equal parts")
        object.__setattr__(self, "split", split)

    def __repr__(self) -> str:
        args = [repr(self.name)]
        if self.size != sympy.Symbol(self.name, positive=True, integer=True):
            args.append(str(self.size) if self.size.is_number else f"sympy.sympify({str(self.size)!r})")
        labels = (("group", self.group), ("stream", self.stream), ("split", self.split))
        args += [f"{k}={v}" for k, v in labels if v is not None]
        return f"Axis({', '.join(args)})"

    def __str__(self) -> str:
        labels = "".join(
            f"{m}{v}" for m, v in (("/", self.group), ("÷", self.split), ("~", self.stream)) if v is not None
        )
        return self.name + labels

    @property
    def is_symbolic(self) -> bool:
        """Whether the size is a symbol or expression rather than a number.

        >>> Axis("q").is_symbolic, Axis("q", 128).is_symbolic
        (True, False)
        """
        return not self.size.is_number

    @property
    def local_size(self) -> sympy.Expr:
        """The extent one core holds at a time: ``s`` if streamed, else ``g`` if tiled, else the size."""
        return self.stream if self.stream is not None else self.group if self.group is not None else self.size

    @property
    def groups(self) -> sympy.Expr:
        """Number of groups (tiles) ``a/g``; 1 for an untiled axis."""
        return self.size / self.group if self.group is not None else sympy.Integer(1)

    @property
    def chunks(self) -> sympy.Expr:
        """Number of stream chunks ``a/s`` (within one group when also tiled); 1 if not streamed."""
        outer = self.group if self.group is not None else self.size
        return outer / self.stream if self.stream is not None else sympy.Integer(1)

    @property
    def parts(self) -> sympy.Expr:
        """The warpgroups each group is split over (:meth:`divided`); 1 when not split."""
        return self.split if self.split is not None else sympy.Integer(1)

    def tiled(self, g) -> Axis:
        """This axis relabelled with group size ``g`` (FAN's group partition)."""
        return Axis(self.name, self.size, group=g, stream=self.stream, split=self.split)

    def streamed(self, s) -> Axis:
        """This axis relabelled with stream size ``s`` (FAN's stream partition)."""
        return Axis(self.name, self.size, group=self.group, stream=s, split=self.split)

    def divided(self, w) -> Axis:
        """This tiled axis with each group split over ``w`` warpgroups (a group partition one level below)."""
        return Axis(self.name, self.size, group=self.group, stream=self.stream, split=w)

    def unlabelled(self) -> Axis:
        """This axis without partition labels."""
        return replace(self, group=None, stream=None, split=None) if self.group or self.stream else self

    def resized(self, size) -> Axis:
        """This axis with a concrete (or other symbolic) size, labels kept."""
        return Axis(self.name, size, group=self.group, stream=self.stream, split=self.split)


def axes(names: str, **sizes) -> tuple[Axis, ...]:
    """Axes from a space-separated string of names; keyword arguments give sizes.

    >>> b, n = axes("b n", n=128)
    >>> (b.size, n.size)
    (b, 128)
    """
    out = tuple(Axis(n, sizes.pop(n, None)) for n in names.split())
    if sizes:
        raise AxisError(f"sizes given for axes not named in {names!r}: {sorted(sizes)}")
    if len({a.name for a in out}) != len(out):
        raise AxisError(f"repeated axis name in {names!r}")
    return out
