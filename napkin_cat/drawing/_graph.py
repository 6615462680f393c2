"""The dataflow a picture shows: boxes joined by nets, with the diagram's rewiring absorbed.

A diagram's swaps only reorder wires, so they vanish: each wire keeps its identity across them.
A copy makes one *net* with several uses (drawn as one wire that branches at dots); a discard is
a use that ends the net at a ground. What is left are the boxes, each in the *column* of its
longest path from the inputs, and the nets between them. An input that feeds a single box beside
other data enters that box *from above* (a parameter, as in Neural Circuit Diagrams); a contraction
whose arrays share axes is *woven* over them (drawn as a stack of boxes).

>>> from napkin_cat import axes, library
>>> flow = dataflow(library.attention(*axes("q x d")))
>>> [(n.kind, n.column) for n in flow.nodes]
[('contraction', 0), ('reduction', 1), ('contraction', 2)]
>>> [wire_label(flow.nets[i].array) for i in flow.parameters]
['x·d', 'x·d']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from napkin_cat.diagram import Array, Diagram, Merge, is_copy, is_swap
from napkin_cat.dtypes import f32


def family(box) -> str:
    """The drawing family of a box: the generator's own ``family``; the structural boxes are ``swap``,
    ``copy``, ``discard`` and ``merge``.

    >>> from napkin_cat import axes, Array, softmax
    >>> from napkin_cat.diagram import Discard, Ty
    >>> q, x = axes("q x")
    >>> family(softmax(Array(q, x), x)), family(Discard(Ty(Array(q))))
    ('reduction', 'discard')
    """
    if is_swap(box):
        return "swap"
    if is_copy(box):
        return "copy" if len(box.cod) else "discard"
    return "merge" if isinstance(box, Merge) else getattr(box, "family", "box")


def wire_label(a: Array) -> str:
    """Axes with their partition labels, and the dtype where it is not f32.

    Axes are joined by ``·``, not ``×``, which is hard to tell from an axis named ``x``.

    >>> from napkin_cat import axes, Array, bf16
    >>> q, x, d = axes("q x d")
    >>> wire_label(Array(q.tiled(128), x.streamed(64), d, dtype=bf16))
    'q/128·x~64·d [bf16]'
    """
    axes_ = "·".join(map(str, a.axes)) or "scalar"
    return axes_ if a.dtype == f32 else f"{axes_} [{a.dtype}]"


@dataclass
class Node:
    """A box of the picture: its input and output nets in port order, and its column."""

    box: object
    kind: str
    ins: list[int]
    outs: list[int]
    column: int = 0


@dataclass
class Net:
    """One array from its source (a node, or ``None`` for the diagram's input ``port``) to its uses:
    ``(node, port)`` pairs, ``node`` ``None`` for the diagram's output ``port``; ``discarded`` if a
    discard ends it."""

    array: Array
    source: int | None
    port: int
    uses: list[tuple[int | None, int]] = field(default_factory=list)
    discarded: bool = False


@dataclass
class Dataflow:
    """Nodes and nets of a diagram; ``parameters`` are the nets that enter their box from above."""

    nodes: list[Node]
    nets: list[Net]
    outputs: list[int]
    parameters: set[int]

    @property
    def width(self) -> int:
        """The number of columns."""
        return 1 + max((n.column for n in self.nodes), default=-1)

    def end(self, net: int) -> int:
        """The column where a net's last use sits (``width`` for an output), ``-1`` if it has none."""
        ends = [self.width if node is None else self.nodes[node].column for node, _ in self.nets[net].uses]
        return max(ends, default=-1)


def dataflow(d: Diagram) -> Dataflow:
    """The nodes and nets of ``d``: one walk over its layers, swaps and copies absorbed into nets."""
    nets = [Net(a, None, j) for j, a in enumerate(d.dom.inside)]
    wires, nodes = list(range(len(nets))), []
    for left, box, _ in d.inside:
        n, k, kind = len(left), len(box.dom), family(box)
        if kind == "swap":
            a = len(box.left)
            wires[n : n + k] = wires[n + a : n + k] + wires[n : n + a]
        elif kind in ("copy", "discard") and k == 1:
            nets[wires[n]].discarded |= not len(box.cod)
            wires[n : n + 1] = [wires[n]] * len(box.cod)
        else:
            node = len(nodes)
            for j, i in enumerate(wires[n : n + k]):
                nets[i].uses.append((node, j))
            outs = list(range(len(nets), len(nets) + len(box.cod)))
            nets += [Net(a, node, j) for j, a in enumerate(box.cod.inside)]
            nodes.append(Node(box, kind, wires[n : n + k], outs))
            wires[n : n + k] = outs
    for j, i in enumerate(wires):
        nets[i].uses.append((None, j))
    flow = Dataflow(nodes, nets, wires, _parameters(nodes, nets))
    for node in nodes:  # nodes come in a topological order
        sources = [nets[i].source for i in node.ins if i not in flow.parameters]
        node.column = max((nodes[s].column + 1 for s in sources if s is not None), default=0)
    return flow


def _parameters(nodes: list[Node], nets: list[Net]) -> set[int]:
    """Inputs used once, by a box that also reads an earlier input or a computed array."""
    found = set()
    for node in nodes:
        if node.kind in ("move", "merge"):
            continue
        for i in node.ins:
            net = nets[i]
            if net.source is None and len(net.uses) == 1 and not net.discarded:
                others = [nets[j] for j in node.ins if j != i]
                if any(o.source is not None or o.port < net.port for o in others):
                    found.add(i)
    return found


def woven(box, kind: str) -> tuple[str, ...]:
    """The axes a contraction is woven over: on every one of its arrays, so each slice is its own box.

    >>> from napkin_cat import axes, contract
    >>> h, q, x, d = axes("h q x d")
    >>> woven(contract("h q d, h x d -> h q x", h, q, x, d), "contraction")
    ('h',)
    """
    if kind != "contraction":
        return ()
    arrays = [*box.dom.inside, *box.cod.inside]
    return tuple(ax.name for ax in arrays[0].axes if all(ax.name in a.names for a in arrays[1:]))
