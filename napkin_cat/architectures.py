"""The architectures of *Neural Circuit Diagrams* (Abbott, 2024) as napkin-cat diagrams.

Each architecture is a diagram whose first input is the data and whose other inputs are its weights;
``batch`` axes weave the data but not the weights (:func:`weave`). Wiring is written as a dataflow
program on named wires (:class:`Circuit`), which inserts the copies, swaps and discards.

>>> from napkin_cat import axes
>>> n, d, h, k, f = axes("n d h k f")
>>> block = transformer_block(n, d, h, k, f)
>>> print(block.dom.inside[0], "→", block.cod)
n×d → n×d
>>> b, i, o, x = axes("b i o x")
>>> print(conv1d(i, o, x, Axis("k", 3), stride=2, batch=(b,)).cod)
b×o×x_out
"""

from __future__ import annotations

from napkin_cat import generators as g
from napkin_cat import library
from napkin_cat.axes import Axis
from napkin_cat.convolution import concat, conv, rename
from napkin_cat.diagram import Array, Copy, Diagram, Discard, Swap, Ty, copy, swap
from napkin_cat.diagram import id as identity
from napkin_cat.errors import AxisError, CompositionError

# --- wiring: dataflow programs and weaving with shared weights --------------------------------------


class Circuit:
    """A dataflow program on named wires, compiled to a string diagram.

    ``let(out, box, *ins)`` applies ``box`` to the named wires; :meth:`diagram` inserts a copy for each
    wire used more than once, swaps to bring the arguments together and discards the unused wires.

    >>> from napkin_cat import axes, add
    >>> (n,) = axes("n")
    >>> c = Circuit(x=Array(n), y=Array(n))
    >>> c.let("s", add(Array(n), Array(n)), "x", "x")
    >>> d = c.diagram("s", "x")
    >>> print(d.dom, "→", d.cod)
    n ⊗ n → n ⊗ n
    >>> import jax.numpy as jnp
    >>> from napkin_cat import to_jax
    >>> to_jax(d)(jnp.ones(2), jnp.zeros(2))
    (Array([2., 2.], dtype=float32), Array([1., 1.], dtype=float32))
    """

    def __init__(self, **inputs: Array):
        self.inputs: dict[str, Array] = {}
        self.types: dict[str, Array] = {}
        self.steps: list[tuple[Diagram, tuple[str, ...], tuple[str, ...]]] = []
        for name, a in inputs.items():
            self.input(name, a)

    def input(self, name: str, a: Array) -> str:
        """Declare one more input wire (inputs come in the order they are declared)."""
        self._bind(name, a)
        self.inputs[name] = a
        return name

    def _bind(self, name: str, a: Array):
        if name in self.types:
            raise CompositionError(f"circuit: wire {name!r} is already bound to {self.types[name].describe()}")
        self.types[name] = a

    def let(self, outs: str, box: Diagram, *ins: str):
        label = getattr(box, "name", f"{box.dom} → {box.cod}")
        """Bind the space-separated names ``outs`` to ``box`` applied to the wires ``ins``."""
        for j, (name, want) in enumerate(zip(ins, box.dom.inside, strict=False)):
            have = self.types.get(name)
            if have is None:
                raise CompositionError(f"circuit: {label!r} reads wire {name!r}, which is not bound")
            if have != want:
                raise CompositionError(
                    f"circuit: input {j} of {label!r} expects {want.describe()}, "
                    f"but wire {name!r} is {have.describe()}"
                )
        if len(ins) != len(box.dom):
            raise CompositionError(f"circuit: {label!r} takes {len(box.dom)} wires ({box.dom}), given {len(ins)}")
        outs_ = tuple(outs.split())
        if len(outs_) != len(box.cod):
            raise CompositionError(f"circuit: {label!r} gives {len(box.cod)} wires, named {len(outs_)}")
        for name, a in zip(outs_, box.cod.inside, strict=True):
            self._bind(name, a)
        self.steps.append((box, tuple(ins), outs_))

    def diagram(self, *outs: str) -> Diagram:
        """The string diagram from the inputs to the wires ``outs``."""
        steps = [*self.steps, (None, outs, ())]
        wires, parts = list(self.inputs), []
        for t, (box, ins, made) in enumerate(steps):
            live = {n for _, later, _ in steps[t:] for n in later}
            for p in reversed([p for p, n in enumerate(wires) if n not in live]):
                parts.append(self._around(wires, p, p + 1, Discard(Ty(self.types[wires[p]]))))
                del wires[p]
            for j, name in enumerate(ins):  # gather the arguments, in order, at the right end
                p = wires.index(name, 0, len(wires) - j)
                if name in ins[j + 1 :] or any(name in later for _, later, _ in steps[t + 1 :]):
                    parts.append(self._around(wires, p, p + 1, copy(self.types[name])))
                    wires.insert(p, name)
                    p += 1
                if p < len(wires) - 1:
                    parts.append(self._around(wires, p, len(wires), swap(self.types[name], self._ty(wires[p + 1 :]))))
                    wires[p:] = [*wires[p + 1 :], name]
            if box is not None:
                parts.append(self._around(wires, len(wires) - len(ins), len(wires), box))
                wires[len(wires) - len(ins) :] = made
        return identity(self._ty(self.inputs)).then(*parts)

    def _ty(self, names) -> Ty:
        return Ty(*(self.types[n] for n in names))

    def _around(self, wires: list[str], start: int, stop: int, box: Diagram) -> Diagram:
        return identity(self._ty(wires[:start])) @ box @ identity(self._ty(wires[stop:]))


def weave(d: Diagram, *axes: Axis, shared=()) -> Diagram:
    """NCD's weaving over ``axes``, except for the inputs at positions ``shared`` (the weights).

    A wire is woven when it depends on a woven input; boxes reading woven and shared wires broadcast
    the shared ones by axis name (every generator's semantics is written over named axes).

    >>> from napkin_cat import axes
    >>> b, n, d, e = axes("b n d e")
    >>> print(weave(library.matmul(n, d, e), b, shared=[1]))
    n d, d e → n e[b×n×d ⊗ d×e → b×n×e]
    """
    if not axes:
        return d
    woven = [i not in set(shared) for i in range(len(d.dom))]
    types = [_woven(a, axes, w) for a, w in zip(d.dom.inside, woven, strict=True)]
    dom, parts = Ty(*types), []
    for left, box, _ in d.inside:
        n, m = len(left), len(box.dom)
        new, flags = _weave_box(box, Ty(*types[n : n + m]), woven[n : n + m], axes)
        parts.append(identity(Ty(*types[:n])) @ new @ identity(Ty(*types[n + m :])))
        types[n : n + m], woven[n : n + m] = new.cod.inside, flags
    return identity(dom).then(*parts)


def _woven(a: Array, axes: tuple[Axis, ...], woven: bool) -> Array:
    return a.with_(axes=(*axes, *a.axes)) if woven else a


def _weave_box(box, dom: Ty, flags: list[bool], axes) -> tuple[Diagram, list[bool]]:
    if isinstance(box, Swap):
        return swap(dom.inside[0], dom.inside[1]), flags[::-1]
    if isinstance(box, Copy | Discard):
        n = len(box.cod)
        return (copy(dom, n) if n else Discard(dom)), flags * n
    flag = any(flags)
    cod = Ty(*(_woven(c, axes, flag) for c in box.cod.inside))
    return type(box)(box.name, dom, cod, data=box.data), [flag] * len(cod)


def _shared(d: Diagram, batch: tuple[Axis, ...]) -> Diagram:
    """Weave the first input (the data) over ``batch``; the weights stay shared."""
    return weave(d, *batch, shared=range(1, len(d.dom)))


def chain(*blocks: Diagram) -> Diagram:
    """Feed each block's output into the next block's first input; the other inputs (weights) stay inputs.

    >>> from napkin_cat import axes
    >>> i, o, c, x = axes("i o c x")
    >>> k = Axis("k", 3)
    >>> chain(conv1d(i, o, x, k, padding=1), resnet_block(c, (x,), (k,)))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CompositionError: chain: block 1 reads c×x:f32@HBM, but block 0 gives o×x:f32@HBM
    """
    d = blocks[0]
    for j, b in enumerate(blocks[1:], 1):
        if d.cod != Ty(b.dom.inside[0]):
            raise CompositionError(
                f"chain: block {j} reads {b.dom.inside[0].describe()}, but block {j - 1} gives "
                + " ⊗ ".join(a.describe() for a in d.cod.inside)
            )
        d = (d @ identity(Ty(*b.dom.inside[1:]))) >> b
    return d


# --- transformers -------------------------------------------------------------------------------------


def self_attention(n: Axis, d: Axis, h: Axis, k: Axis, *, causal: bool = False, batch: tuple[Axis, ...] = ()):
    """Multi-head self-attention with projections: ``X[n,d] ⊗ Wq[d,h,k] ⊗ Wk ⊗ Wv ⊗ Wo[h,k,d] → Y[n,d]``.

    Keys and values index the sequence under a second name, ``{n}_kv``, so that scores are ``[h, n, n_kv]``.

    >>> from napkin_cat import axes
    >>> n, d, h, k = axes("n d h k")
    >>> print(self_attention(n, d, h, k).cod)
    n×d
    """
    m = Axis(f"{n.name}_kv", n.size)
    c = Circuit(X=Array(n, d), Wq=Array(d, h, k), Wk=Array(d, h, k), Wv=Array(d, h, k), Wo=Array(h, k, d))
    c.let("Xm", rename(Array(n, d), n, m), "X")
    project = lambda s: g.contract(f"{s.name} {d.name}, {d.name} {h.name} {k.name} -> {h.name} {s.name} {k.name}",
                                   s, d, h, k)  # noqa: E731
    c.let("Q", project(n), "X", "Wq")
    c.let("K", project(m), "Xm", "Wk")
    c.let("V", project(m), "Xm", "Wv")
    c.let("O", library.multi_head_attention(h, n, m, k, causal=causal), "Q", "K", "V")
    c.let("Y", g.contract(f"{h.name} {n.name} {k.name}, {h.name} {k.name} {d.name} -> {n.name} {d.name}",
                          h, n, k, d), "O", "Wo")
    return _shared(c.diagram("Y"), batch)


def transformer_block(
    n: Axis, d: Axis, h: Axis, k: Axis, f: Axis, *, causal: bool = False, activation: str = "gelu",
    batch: tuple[Axis, ...] = (),
) -> Diagram:
    """Pre-norm transformer block: ``Y = X + SA(LN₁(X))``, ``Z = Y + MLP(LN₂(Y))``.

    Inputs: ``X[n,d] ⊗ γ₁[d] ⊗ β₁[d] ⊗ Wq[d,h,k] ⊗ Wk ⊗ Wv ⊗ Wo[h,k,d] ⊗ γ₂ ⊗ β₂ ⊗ W₁[d,f] ⊗ b₁[f] ⊗ W₂[f,d]
    ⊗ b₂[d]``; output ``Z[n,d]`` (with the ``batch`` axes in front of ``X`` and ``Z``).

    >>> from napkin_cat import axes
    >>> b, n, d, h, k, f = axes("b n d h k f")
    >>> len(transformer_block(n, d, h, k, f, batch=(b,)).dom)
    13
    """
    N, D = Array(n, d), Array(d)
    c = Circuit(X=N, g1=D, b1=D, Wq=Array(d, h, k), Wk=Array(d, h, k), Wv=Array(d, h, k), Wo=Array(h, k, d))
    for name, a in dict(g2=D, b2=D, W1=Array(d, f), c1=Array(f), W2=Array(f, d), c2=D).items():
        c.input(name, a)
    c.let("U", library.layer_norm(n, d), "X", "g1", "b1")
    c.let("A", self_attention(n, d, h, k, causal=causal), "U", "Wq", "Wk", "Wv", "Wo")
    c.let("Y", g.add(N, N), "X", "A")
    c.let("V", library.layer_norm(n, d), "Y", "g2", "b2")
    c.let("M", library.mlp(n, d, f, d, activation=activation), "V", "W1", "c1", "W2", "c2")
    c.let("Z", g.add(N, N), "Y", "M")
    return _shared(c.diagram("Z"), batch)


# --- convolutional networks ----------------------------------------------------------------------------


def convolution(
    i: Axis, o: Axis, xs: tuple[Axis, ...], ks: tuple[Axis, ...], *, stride=1, padding=0,
    out: tuple[Axis, ...] | None = None, batch: tuple[Axis, ...] = (),
) -> Diagram:
    """A convolution layer with bias: ``X[i,*xs] ⊗ W[o,i,*ks] ⊗ b[o] → Y[o,*ys]`` (see :func:`conv`).

    >>> from napkin_cat import axes
    >>> i, o, x, y = axes("i o x y")
    >>> print(convolution(i, o, (x, y), (Axis("kx", 3), Axis("ky", 3)), padding="same").cod)
    o×x×y
    """
    cv = conv(Array(i, *xs), Array(o, i, *ks), stride=stride, padding=padding, out=out)
    return _shared((cv @ identity(Array(o))) >> g.add(cv.out, Array(o)), batch)


def conv1d(i: Axis, o: Axis, x: Axis, k: Axis, **kw) -> Diagram:
    """A 1-D convolution layer ``X[i,x] ⊗ W[o,i,k] ⊗ b[o] → Y[o,y]``; keywords as :func:`convolution`."""
    return convolution(i, o, (x,), (k,), **kw)


def conv2d(i: Axis, o: Axis, xy: tuple[Axis, Axis], kxy: tuple[Axis, Axis], **kw) -> Diagram:
    """A 2-D convolution layer ``X[i,x,y] ⊗ W[o,i,kx,ky] ⊗ b[o] → Y[o,x',y']``; keywords as :func:`convolution`."""
    return convolution(i, o, tuple(xy), tuple(kxy), **kw)


def _conv_relu(c: Circuit, src: str, i: Axis, o: Axis, xs, ks, tag: str) -> str:
    """Declare weights ``W{tag}[o,i,*ks]``, ``b{tag}[o]``; bind ``{tag}`` to ``relu(conv(src) + b)``."""
    layer = convolution(i, o, xs, ks, padding="same")
    c.let(f"{tag}_", layer, src, c.input(f"W{tag}", Array(o, i, *ks)), c.input(f"b{tag}", Array(o)))
    c.let(tag, g.relu(layer.cod), f"{tag}_")
    return tag


def _double_conv(c: Circuit, src: str, i: Axis, o: Axis, xs, ks, tag: str) -> str:
    """Two 'same' convolutions with ReLU, ``i → o_h → o`` (a weight's two channel axes need two names)."""
    mid = Axis(f"{o.name}_h", o.size)
    return _conv_relu(c, _conv_relu(c, src, i, mid, xs, ks, f"{tag}a"), mid, o, xs, ks, f"{tag}b")


def resnet_block(c_: Axis, xs: tuple[Axis, ...], ks: tuple[Axis, ...], *, batch: tuple[Axis, ...] = ()):
    """Basic residual block: ``relu(X + conv₂(relu(conv₁(X) + b₁)) + b₂)``, 'same' padding, ``c`` channels.

    Inputs ``X[c,*xs] ⊗ W₁[c_h,c,*ks] ⊗ b₁[c_h] ⊗ W₂[c,c_h,*ks] ⊗ b₂[c]``, where ``c_h`` is a second name
    for the channels (a weight's two channel axes need two names); batch norm is folded into the biases
    (its inference form).

    >>> from napkin_cat import axes
    >>> c, x, y = axes("c x y")
    >>> print(resnet_block(c, (x, y), (Axis("kx", 3), Axis("ky", 3))).cod)
    c×x×y
    """
    X, mid = Array(c_, *xs), Axis(f"{c_.name}_h", c_.size)
    circ = Circuit(X=X)
    h = _conv_relu(circ, "X", c_, mid, xs, ks, "1")
    layer = convolution(mid, c_, xs, ks, padding="same")
    circ.let("2", layer, h, circ.input("W2", Array(c_, mid, *ks)), circ.input("b2", Array(c_)))
    circ.let("S", g.add(X, X), "X", "2")
    circ.let("Y", g.relu(X), "S")
    return _shared(circ.diagram("Y"), batch)


def max_pool(A: Array, xs: tuple[Axis, ...], window: int = 2) -> Diagram:
    """Max pooling by ``window`` (stride = window) over the axes ``xs``: split each, then max over the window.

    >>> from napkin_cat import axes
    >>> c, x, y = axes("c x y")
    >>> print(max_pool(Array(c, x, y), (x, y)).cod)
    c×x1×y1
    """
    parts, a = [], A
    for x in xs:
        s = g.split(a, x, _coarser(x, window), Axis(f"p{x.name}", window))
        parts.append(s)
        a = s.out
    for x in xs:
        r = g.reduce_max(a, f"p{x.name}")
        parts.append(r)
        a = r.out
    return identity(A).then(*parts)


def up_conv(A: Array, i: Axis, o: Axis, xs: tuple[Axis, ...], fine: tuple[Axis, ...], window: int = 2) -> Diagram:
    """Transposed convolution with kernel = stride = ``window``: a contraction, then merges of axes.

    ``A[i,*xs] ⊗ U[i,o,*us] → Y[o,*fine]`` with ``Y[o, w·x + u] = Σᵢ A[i,x] U[i,o,u]``.

    >>> from napkin_cat import axes
    >>> i, o, x = axes("i o x")
    >>> print(up_conv(Array(i, x), i, o, (x,), (Axis("X", 2 * x.size),)).cod)
    o×X
    """
    us = tuple(Axis(f"u{x.name}", window) for x in xs)
    lhs = " ".join(a.name for a in A.axes)
    rhs = " ".join(a.name for a in (i, o, *us))
    res = " ".join([o.name, *(f"{x.name} {u.name}" for x, u in zip(xs, us, strict=True))])
    z = g.contract(f"{lhs}, {rhs} -> {res}", *A.axes, o, *us)
    parts, a = [z], z.out
    for x, u, y in zip(xs, us, fine, strict=True):
        m = g.merge(a, x, u, into=y)
        parts.append(m)
        a = m.out
    return z.then(*parts[1:])


def _coarser(x: Axis, factor: int) -> Axis:
    base = x.name.rstrip("0123456789")
    level = int(x.name[len(base) :] or 0) + 1
    return Axis(f"{base}{level}", x.size / factor)


def unet(i: Axis, w: Axis, o: Axis, xy: tuple[Axis, Axis], *, depth: int = 1, kernel: int = 3,
         batch: tuple[Axis, ...] = ()) -> Diagram:
    """A small U-Net: per level two 'same' ``kernel``² convolutions with ReLU, 2×2 max pooling down,
    a 2×2 transposed convolution up, concatenation with the skip connection, and a 1×1 head.

    Level ``l`` has ``w·2ˡ`` channels and spatial sizes ``x/2ˡ``, so ``x`` and ``y`` must be divisible
    by ``2^depth``. Inputs: ``X[i,x,y]``, then the weights in the order they are used: encoder
    ``W[o,i,kx,ky], b[o]`` pairs level by level (each ``i → o_h → o``), then per level upwards the
    up-convolution ``U[2w,w,2,2], c[w]`` and two decoder pairs, then the head ``H[w,o], h[o]``.

    >>> from napkin_cat import axes
    >>> i, w, o, x, y = axes("i w o x y")
    >>> net = unet(i, w, o, (x, y))
    >>> print(net.dom.inside[0], "→", net.cod, "with", len(net.dom), "inputs")
    i×x×y → o×x×y with 17 inputs
    >>> unet(i, w, o, (Axis("x", 6), y), depth=2)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: unet: axis 'x' of size 6 is not divisible by 2^depth = 4
    """
    for x in xy:
        if x.size.is_number and x.size % 2**depth:
            raise AxisError(f"unet: axis {x.name!r} of size {x.size} is not divisible by 2^depth = {2**depth}")
    ks = (Axis("kx", kernel), Axis("ky", kernel))
    widths = [w, *(Axis(f"{w.name}{lv}", w.size * 2**lv) for lv in range(1, depth + 1))]
    grids = [tuple(xy)]
    for _ in range(depth):
        grids.append(tuple(_coarser(x, 2) for x in grids[-1]))
    c = Circuit(X=Array(i, *xy))
    skips, src, ch = [], "X", i
    for lv in range(depth + 1):  # encoder, then the bottleneck
        src, ch = _double_conv(c, src, ch, widths[lv], grids[lv], ks, f"e{lv}"), widths[lv]
        if lv < depth:
            skips.append(src)
            c.let(f"p{lv}", max_pool(Array(ch, *grids[lv]), grids[lv]), src)
            src = f"p{lv}"
    for lv in reversed(range(depth)):  # decoder
        wide, narrow, grid = widths[lv + 1], widths[lv], grids[lv]
        up = up_conv(Array(wide, *grids[lv + 1]), wide, narrow, grids[lv + 1], grid)
        c.let(f"u{lv}_", up, src, c.input(f"U{lv}", up.dom.inside[1]))
        c.let(f"u{lv}", _bias(up.cod.inside[0], narrow), f"u{lv}_", c.input(f"c{lv}", Array(narrow)))
        cat = Axis(f"{narrow.name}_cat", 2 * narrow.size)
        c.let(f"m{lv}", concat(Array(narrow, *grid), Array(narrow, *grid), narrow, narrow, cat), skips[lv], f"u{lv}")
        src = _double_conv(c, f"m{lv}", cat, narrow, grid, ks, f"d{lv}")
    head = g.contract(f"{w.name} {xy[0].name} {xy[1].name}, {w.name} {o.name} -> {o.name} {xy[0].name} {xy[1].name}",
                      w, o, *xy)
    c.let("Y_", head, src, c.input("H", Array(w, o)))
    c.let("Y", _bias(head.out, o), "Y_", c.input("h", Array(o)))
    return _shared(c.diagram("Y"), batch)


def _bias(A: Array, c_: Axis) -> Diagram:
    return g.add(A, Array(c_))


# --- vision transformer -----------------------------------------------------------------------------


def tokens(xy: tuple[Axis, Axis], patch: int, *, cls_token: bool = True) -> Axis:
    """The token axis of a vision transformer: one token per ``patch``² patch, plus the class token.

    >>> from napkin_cat import axes
    >>> tokens(axes("x y"), 4).size
    x*y/16 + 1
    """
    x, y = xy
    return Axis("t", x.size * y.size / patch**2 + (1 if cls_token else 0))


def patch_embedding(c_: Axis, xy: tuple[Axis, Axis], d: Axis, *, patch: int, cls_token: bool = True,
                    batch: tuple[Axis, ...] = ()) -> Diagram:
    """ViT patch embedding: cut ``X[c,x,y]`` into ``patch``² patches, project them linearly to ``d``,
    prepend a class token and add position embeddings.

    Inputs ``X[c,x,y] ⊗ W[c,px,py,d] ⊗ b[d] ⊗ cls[1,d] ⊗ E[t,d]`` (no ``cls`` without the class token);
    output ``[t,d]`` with ``t`` = :func:`tokens`.

    >>> from napkin_cat import axes
    >>> c, x, y, d = axes("c x y d")
    >>> print(patch_embedding(c, (x, y), d, patch=4).cod)
    t×d
    """
    x, y = xy
    (xp, yp), (px, py) = (Axis(f"{a.name}p", a.size / patch) for a in xy), (Axis("px", patch), Axis("py", patch))
    n, t = Axis("n", xp.size * yp.size), tokens(xy, patch, cls_token=cls_token)
    X = Array(c_, x, y)
    circ = Circuit(X=X)
    s1 = g.split(X, x, xp, px)
    s2 = g.split(s1.out, y, yp, py)
    z = g.contract(f"{c_.name} xp px yp py, {c_.name} px py {d.name} -> xp yp {d.name}", c_, xp, px, yp, py, d)
    m = g.merge(z.out, xp, yp, into=n)
    circ.let("P", s1 >> s2, "X")
    circ.let("E_", (z >> m), "P", circ.input("W", Array(c_, px, py, d)))
    circ.let("E", g.add(Array(n, d), Array(d)), "E_", circ.input("b", Array(d)))
    if cls_token:
        one = Axis("one", 1)
        circ.let("T", concat(Array(one, d), Array(n, d), one, n, into=t), circ.input("cls", Array(one, d)), "E")
    else:
        circ.let("T", rename(Array(n, d), n, t), "E")
    circ.let("Y", g.add(Array(t, d), Array(t, d)), "T", circ.input("pos", Array(t, d)))
    return _shared(circ.diagram("Y"), batch)


def vit_encoder_block(t: Axis, d: Axis, h: Axis, k: Axis, f: Axis, *, batch: tuple[Axis, ...] = ()) -> Diagram:
    """The ViT encoder block: the pre-norm :func:`transformer_block` with a GELU MLP, over tokens ``t``."""
    return transformer_block(t, d, h, k, f, activation="gelu", batch=batch)


def vision_transformer(c_: Axis, xy: tuple[Axis, Axis], d: Axis, h: Axis, k: Axis, f: Axis, *, patch: int,
                       layers: int = 1, batch: tuple[Axis, ...] = ()) -> Diagram:
    """Patch embedding followed by ``layers`` encoder blocks: ``X[c,x,y] ⊗ weights → Z[t,d]``.

    >>> from napkin_cat import axes
    >>> c, x, y, d, h, k, f = axes("c x y d h k f")
    >>> vit = vision_transformer(c, (x, y), d, h, k, f, patch=16, layers=2)
    >>> print(vit.cod, len(vit.dom))
    t×d 29
    """
    t = tokens(xy, patch)
    blocks = [vit_encoder_block(t, d, h, k, f, batch=batch) for _ in range(layers)]
    return chain(patch_embedding(c_, xy, d, patch=patch, batch=batch), *blocks)


ARCHITECTURES = (
    "self_attention", "transformer_block", "conv1d", "conv2d", "resnet_block", "unet", "patch_embedding",
    "vit_encoder_block", "vision_transformer",
)
"""The public architectures, in the order the paper introduces them."""

__all__ = [*ARCHITECTURES, "Circuit", "chain", "convolution", "max_pool", "tokens", "up_conv", "weave"]
