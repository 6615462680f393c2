"""The adapter to discopy: arrays are objects, generators are boxes, diagrams are ``discopy.markov`` diagrams.

This is the only module that imports discopy. Objects are :class:`Array` types (axes, dtype, memory
level); a wire carries one array. Composition ``>>`` and tensor ``@`` are discopy's, with typed errors
that name the offending wires. Diagrams compare equal up to interchange, swaps and copies: two
diagrams are equal when they compute the same terms from their inputs.

>>> from napkin_cat.axes import axes
>>> q, d = axes("q d")
>>> A = Array(q, d)
>>> A
Array(Axis('q'), Axis('d'))
>>> print(A)
q×d
>>> A @ A
Ty(Array(Axis('q'), Axis('d')), Array(Axis('q'), Axis('d')))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy
from discopy import cat, markov, monoidal
from discopy.cat import factory

from napkin_cat.axes import Axis
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.dtypes import dtype as as_dtype
from napkin_cat.errors import AxisError, CompositionError
from napkin_cat.levels import HBM, Level
from napkin_cat.levels import level as as_level


class Array(cat.Ob):
    """An array type: named axes, a dtype and a memory level (the wire's colour).

    >>> from napkin_cat.axes import Axis
    >>> from napkin_cat.dtypes import bf16
    >>> Array(Axis("n", 8), dtype=bf16).shape
    (8,)
    """

    def __init__(self, *axes: Axis, dtype: Dtype | str = f32, level: Level | str = HBM):
        for i, a in enumerate(axes):
            if not isinstance(a, Axis):
                raise AxisError(f"Array: argument {i} is {type(a).__name__} {a!r}, not an Axis; {_axis_fix(a)}")
        names = [a.name for a in axes]
        if len(set(names)) != len(names):
            raise AxisError(f"repeated axis in array {'×'.join(names)}")
        self.axes, self.dtype, self.level = tuple(axes), as_dtype(dtype), as_level(level)
        super().__init__("×".join(str(a) for a in axes) or "scalar")

    def __eq__(self, other):
        return isinstance(other, Array) and (self.axes, self.dtype, self.level) == (
            other.axes,
            other.dtype,
            other.level,
        )

    def __hash__(self):
        return hash((self.axes, self.dtype, self.level))

    def __repr__(self):
        extra = "".join(
            f", {k}={v}" for k, v, default in (("dtype", self.dtype, f32), ("level", self.level, HBM)) if v != default
        )
        return f"Array({', '.join(map(repr, self.axes))}{extra})"

    def __str__(self):
        return self.name

    def __matmul__(self, other):
        return Ty(self) @ other

    def describe(self) -> str:
        """Axes, dtype and level, for error messages: ``q×d:bf16@HBM``."""
        return f"{self.name}:{self.dtype}@{self.level}"

    @property
    def names(self) -> tuple[str, ...]:
        """The axis names, in order.

        >>> from napkin_cat.axes import axes
        >>> Array(*axes("q d")).names
        ('q', 'd')
        """
        return tuple(a.name for a in self.axes)

    @property
    def shape(self) -> tuple:
        """Sizes of the axes (sympy expressions; ints where concrete)."""
        return tuple(int(a.size) if a.size.is_number else a.size for a in self.axes)

    @property
    def size(self) -> sympy.Expr:
        """Number of elements, a sympy expression."""
        return sympy.Mul(*(a.size for a in self.axes))

    @property
    def local_size(self) -> sympy.Expr:
        """Elements one core holds at a time: tiled axes count ``g``, streamed axes ``s``."""
        return sympy.Mul(*(a.local_size for a in self.axes))

    def axis(self, name: str) -> Axis:
        """The axis called ``name``; :class:`AxisError` if the array has none.

        >>> from napkin_cat.axes import axes
        >>> Array(*axes("q d")).axis("d")
        Axis('d')
        """
        for a in self.axes:
            if a.name == name:
                return a
        raise AxisError(f"array {self.describe()} has no axis {name!r}")

    def has(self, name: str) -> bool:
        """Whether the array has an axis called ``name``.

        >>> from napkin_cat.axes import axes
        >>> A = Array(*axes("q d"))
        >>> A.has("q"), A.has("x")
        (True, False)
        """
        return name in self.names

    def with_(self, *, axes: Iterable[Axis] | None = None, dtype=None, level=None) -> Array:
        """A copy with some of axes, dtype and level replaced."""
        return Array(
            *(self.axes if axes is None else axes),
            dtype=self.dtype if dtype is None else dtype,
            level=self.level if level is None else level,
        )


@factory
class Ty(monoidal.Ty):
    """A tuple of arrays (the monoidal product).

    >>> from napkin_cat.axes import axes
    >>> q, d = axes("q d")
    >>> T = Ty(Array(q, d), Array(d))
    >>> print(T)
    q×d ⊗ d
    >>> len(T)
    2
    """

    ob_factory = Array

    def __init__(self, *inside):
        # discopy's checks and coercions, which arrays pass as they are, in one pass: types are built by the
        # hundred thousand (each layer of a diagram makes several), and discopy's checks cost more than the rest
        if all(isinstance(x, Array) for x in inside):
            self.inside, self.name = inside, " ⊗ ".join(x.name for x in inside) or "Ty()"
        else:
            super().__init__(*inside)

    def tensor(self, *others):
        if all(isinstance(t, Ty) for t in others):  # one factory: discopy's checks pass
            return Ty(*self.inside, *(x for t in others for x in t.inside))
        return super().tensor(*others)

    def __hash__(self):  # discopy hashes the repr, every axis written out; equal types have equal arrays
        return hash(self.inside)

    def __repr__(self):
        return f"Ty({', '.join(map(repr, self.inside))})"

    def __str__(self):
        return " ⊗ ".join(map(str, self.inside)) or "Ty()"

    def __matmul__(self, other):
        return self.tensor(Ty(other) if isinstance(other, Array) else other)


def _axis_fix(a) -> str:
    """How to write the axis the user meant by ``a`` (a name, a size, a pair)."""
    if isinstance(a, str) and a.isidentifier():
        return f"write nc.Axis({a!r}, n) for an axis of size n, or nc.Axis({a!r}) for a symbolic size"
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):
        return f"write nc.Axis({a[0]!r}, {a[1]!r})"
    if isinstance(a, int | sympy.Expr):
        return f"a size needs an axis name: nc.Axis('n', {a!r})"
    return "pass axes made by nc.Axis(name, size) or nc.axes('q x d', d=64)"


def as_ty(x) -> Ty:
    """Coerce an :class:`Array`, a :class:`Ty` or an iterable of arrays to a :class:`Ty`."""
    if isinstance(x, Ty):
        return x
    if isinstance(x, Array):
        return Ty(x)
    return Ty(*x)


def _mismatch(left: Ty, right: Ty) -> str:
    if len(left) != len(right):
        return f"{len(left)} wires ({left}) cannot feed {len(right)} wires ({right})"
    lines = []
    for i, (a, b) in enumerate(zip(left.inside, right.inside, strict=True)):
        if a == b:
            continue
        why = []
        if a.names != b.names:
            why.append(f"axes {a.name} ≠ {b.name}")
        elif a.axes != b.axes:
            why += [f"axis {x.name}: {x!r} ≠ {y!r}" for x, y in zip(a.axes, b.axes, strict=True) if x != y]
        if a.dtype != b.dtype:
            why.append(f"dtype {a.dtype} ≠ {b.dtype}")
        if a.level != b.level:
            why.append(f"level {a.level} ≠ {b.level}")
        lines.append(f"wire {i}: {a.describe()} → {b.describe()} ({'; '.join(why)})")
    return "; ".join(lines)


@factory
class Diagram(markov.Diagram):
    """A string diagram of array operations.

    >>> from napkin_cat import library, axes
    >>> q, x, d = axes("q x d")
    >>> attn = library.attention(q, x, d)
    >>> print(attn.dom)
    q×d ⊗ x×d ⊗ x×d
    >>> attn == library.attention(q, x, d)
    True
    """

    ty_factory = Ty

    def then(self, *others):
        cod, resolved = self.cod, []
        for other in others:
            other = other(cod) if isinstance(other, Template) else other
            if not isinstance(other, Diagram):
                raise CompositionError(
                    f"cannot compose (>>) a diagram with {type(other).__name__} {other!r}: the other side must be "
                    "a Diagram or a Template"
                )
            if cod != other.dom:
                raise CompositionError(f"cannot compose: {_mismatch(cod, other.dom)}")
            resolved.append(other)
            cod = other.cod
        return super().then(*resolved)

    def __rshift__(self, other):
        return self.then(other)

    def tensor(self, other=None, *others):
        if isinstance(other, Array | Ty):
            other = Diagram.id(as_ty(other))
        for o in (other, *others):
            if o is not None and not isinstance(o, Diagram):
                raise CompositionError(
                    f"cannot tensor (@) a diagram with {type(o).__name__} {o!r}: the other side must be a Diagram, "
                    "an Array or a Ty (a wire beside the diagram: d @ nc.Array(n))"
                )
        return super().tensor(other, *others) if other is not None else self

    def __matmul__(self, other):
        return self.tensor(other)

    # --- functors on objects: the relabellings are built from this one map --------------------
    def map_arrays(self, f: Callable[[Array], Array]) -> Diagram:
        """The diagram with every wire's array replaced by ``f(array)``, boxes retyped to match.

        A flat, linear-time walk over the layers (discopy's functor is quadratic).
        """

        def ty(t):
            return Ty(*map(f, t.inside))

        layers = tuple(monoidal.Layer(ty(left), _retype(box, ty), ty(right)) for left, box, right in self.inside)
        return Diagram(layers, ty(self.dom), ty(self.cod), _scan=False)

    def weave(self, *axes: Axis) -> Diagram:
        """Broadcast the diagram over new leading axes (NCD's weaving; ``jax.vmap``).

        >>> from napkin_cat import library, axes
        >>> h, q, x, d = axes("h q x d")
        >>> print(library.attention(q, x, d).weave(h).cod)
        h×q×d
        """
        for a in axes:
            if not isinstance(a, Axis):
                raise AxisError(f"weave takes Axis objects, got {a!r}")
        names = {a.name for a in axes}
        for wire in set(self.dom.inside) | set(self.cod.inside) | {o for b in self.boxes for o in b.dom.inside}:
            clash = names & set(wire.names)
            if clash:
                raise AxisError(f"cannot weave over {sorted(clash)}: wire {wire.describe()} already has it")
        return self.map_arrays(lambda a: a.with_(axes=(*axes, *a.axes)))

    def dataflow(self, values: list, step: Callable, *, structural: Callable | None = None) -> list:
        """The one walk over the diagram's dataflow: ``step(i, box, ins)`` gives the outputs of the box of
        layer ``i`` from the values on its inputs; swaps and copies move the values themselves (calling
        ``structural(i, box, ins, outs)`` when given). Returns the values on the output wires.

        >>> from napkin_cat import axes, exp, swap
        >>> A = Array(*axes("n"))
        >>> (exp(A) @ A >> swap(A, A)).dataflow(["a", "b"], lambda i, box, ins: [f"{box.name}({ins[0]})"])
        ['b', 'exp(a)']
        """
        stack = list(values)
        for i, (left, box, _) in enumerate(self.inside):
            n, k = len(left), len(box.dom)
            ins = stack[n : n + k]
            if is_structural(box):
                outs = ins[::-1] if is_swap(box) else ins * (len(box.cod) // max(k, 1))
                if structural is not None:
                    structural(i, box, ins, outs)
            else:
                outs = step(i, box, ins)
            stack[n : n + k] = outs
        return stack

    def with_layers(self, layers: Iterable, *, cod: Ty | None = None) -> Diagram:
        """The diagram whose layers are ``(left, box, right)`` triples (boxes replaced, removed or added
        in place), with this diagram's domain and its codomain (or ``cod``); types are not re-checked.

        >>> from napkin_cat import axes, exp, log
        >>> A = Array(*axes("n"))
        >>> d = exp(A) >> exp(A)
        >>> print(d.with_layers([(left, log(A), right) for left, _, right in d.inside]))
        log[n → n] >> log[n → n]
        """
        layers = tuple(monoidal.Layer(*layer) for layer in layers)
        return Diagram(layers, self.dom, self.cod if cod is None else cod, _scan=False)

    def producer(self, j: int, pos: int) -> tuple[int | None, int]:
        """The layer index and output port of the box producing the wire at ``pos`` entering layer ``j``
        (``j = len(self.inside)`` for the outputs); ``(None, i)`` when it is the input wire ``i``."""
        for i in range(j - 1, -1, -1):
            left, box, _ = self.inside[i]
            n = len(left)
            if pos >= n + len(box.cod):
                pos += len(box.dom) - len(box.cod)
            elif pos >= n:
                return i, pos - n
        return None, pos

    # --- equality up to interchange, swaps and copies ----------------------------------------
    def terms(self) -> tuple:
        """The output terms: each output as the nested application of boxes to input positions."""

        def step(i, box, ins):
            return [((box.name, box.dom, box.cod, box.data, tuple(ins)), k) for k in range(len(box.cod))]

        return tuple(self.dataflow([("in", i) for i in range(len(self.dom))], step))

    def __eq__(self, other):
        if not isinstance(other, Diagram):
            return False
        return (self.dom, self.cod) == (other.dom, other.cod) and (
            self.inside == other.inside or self.terms() == other.terms()
        )

    def __hash__(self):
        return hash((self.dom, self.cod, self.terms()))

    def __str__(self):
        return " >> ".join(_layer_str(layer) for layer in self.inside) or f"Id({self.dom})"


def _layer_str(layer) -> str:
    box = layer[1]
    return f"{box.name}[{box.dom} → {box.cod}]"


def _retype(box, ty):
    if is_swap(box):
        return Swap(ty(box.left), ty(box.right))
    if is_copy(box):
        return Copy(ty(box.dom), len(box.cod))
    return box.retyped(ty(box.dom), ty(box.cod))


def is_swap(box) -> bool:
    """Whether ``box`` is a swap (a symmetry: its outputs are its inputs, exchanged).

    >>> from napkin_cat.axes import axes
    >>> A = Array(*axes("n"))
    >>> is_swap(swap(A, A).boxes[0]), is_swap(copy(A))
    (True, False)
    """
    return isinstance(box, markov.Swap)


def is_copy(box) -> bool:
    """Whether ``box`` is a copy (a discard is a copy into no wires).

    >>> from napkin_cat.axes import axes
    >>> A = Array(*axes("n"))
    >>> is_copy(copy(A)), is_copy(discard(A))
    (True, True)
    """
    return isinstance(box, markov.Copy)


def is_structural(box) -> bool:
    """Whether ``box`` only rewires (a swap or a copy): it computes nothing.

    >>> from napkin_cat.axes import axes
    >>> A = Array(*axes("n"))
    >>> is_structural(copy(A)), is_structural(swap(A, A).boxes[0])
    (True, True)
    """
    return isinstance(box, markov.Swap | markov.Copy)


class Box(markov.Box, Diagram):
    """A box whose parameters are a hashable tuple in ``data``; subclasses are the generators.

    >>> from napkin_cat import axes, library
    >>> box, = library.matmul(*axes("a b c")).boxes
    >>> isinstance(box, Box), box.family
    (True, 'contraction')
    >>> print(box.dom, "→", box.cod)
    a×b ⊗ b×c → a×c
    """

    __ambiguous_inheritance__ = (markov.Box,)
    #: the drawing family (its shape and colour in a picture)
    family = "box"

    def retyped(self, dom: Ty, cod: Ty) -> Box:
        """The same generator on other wires (used by weaving and the relabellings)."""
        return type(self)(self.name, dom, cod, data=self.data)


class Copy(markov.Copy, Box):
    """Copy a wire ``n`` times (``n = 0`` discards it)."""

    __ambiguous_inheritance__ = (markov.Copy,)
    family = "copy"

    def __init__(self, x, n: int = 2):
        markov.Copy.__init__(self, as_ty(x), n)


class Discard(markov.Discard, Copy):
    """Discard a wire (a copy into zero wires)."""

    __ambiguous_inheritance__ = (markov.Discard,)
    family = "discard"


class Merge(markov.Merge, Box):
    """Merge wires (the monoid dual to a copy)."""

    __ambiguous_inheritance__ = (markov.Merge,)
    family = "merge"


class Swap(markov.Swap, Box):
    """Swap two wires."""

    __ambiguous_inheritance__ = (markov.Swap,)
    family = "swap"


Diagram.copy_factory, Diagram.merge_factory = Copy, Merge
Diagram.braid_factory, Diagram.discard_factory = Swap, Discard


def relabel(diagram: Diagram, **labels) -> Diagram:
    """FAN's partition labels set by axis name, with no side conditions checked (the rules in ``rewrites``
    check them): ``q=("group", g)`` tiles ``q`` by ``g``, ``x=("stream", s)`` streams ``x`` by ``s``.

    >>> from napkin_cat import axes, library
    >>> a, b, c = axes("a b c")
    >>> print(relabel(library.matmul(a, b, c), a=("group", 64)).cod)
    a/64×c
    """

    def axis(ax):
        if ax.name not in labels:
            return ax
        kind, size = labels[ax.name]
        return ax.tiled(size) if kind == "group" else ax.streamed(size)

    return diagram.map_arrays(lambda w: w.with_(axes=[axis(ax) for ax in w.axes]))


def id(x: Array | Ty | Iterable[Array] = ()) -> Diagram:  # noqa: A001 - the identity, as in the mathematics
    """The identity on an array or tuple of arrays.

    >>> from napkin_cat.axes import axes
    >>> A = Array(*axes("q d"))
    >>> print(id(A).cod)
    q×d
    >>> id(A) >> id(A) == id(A)
    True
    """
    return Diagram.id(as_ty(x))


def copy(x: Array | Ty | Iterable[Array], n: int = 2) -> Diagram:
    """Copy an array ``n`` times.

    >>> from napkin_cat.axes import axes
    >>> print(copy(Array(*axes("q d")), 3).cod)
    q×d ⊗ q×d ⊗ q×d
    """
    return Copy(as_ty(x), n)


def discard(x: Array | Ty | Iterable[Array]) -> Diagram:
    """Discard an array.

    >>> from napkin_cat.axes import axes
    >>> print(discard(Array(*axes("q d"))).cod)
    Ty()
    """
    return Discard(as_ty(x))


def swap(x: Array | Ty | Iterable[Array], y: Array | Ty | Iterable[Array]) -> Diagram:
    """Swap two arrays.

    >>> from napkin_cat.axes import axes
    >>> q, d = axes("q d")
    >>> print(swap(Array(q, d), Array(q)).cod)
    q ⊗ q×d
    """
    return Diagram.swap(as_ty(x), as_ty(y))


class Template:
    """A generator waiting for the array it acts on: ``d >> nc.softmax(x)`` instantiates it on ``d.cod``.

    >>> from napkin_cat import axes, softmax, Array
    >>> q, x = axes("q x")
    >>> print((id(Array(q, x)) >> softmax(x)).cod)
    q×x
    """

    def __init__(self, make: Callable, *args, **kwargs):
        self.make, self.args, self.kwargs = make, args, kwargs

    def __call__(self, ty) -> Diagram:
        ty = as_ty(ty)
        return self.make(*ty.inside, *self.args, **self.kwargs)

    def __repr__(self):
        return f"{self.make.__name__}(…, {', '.join(map(repr, self.args))})"
