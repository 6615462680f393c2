"""The XLA backend behind the registry's seam (:class:`lowering._registry.Backend`): ``"auto"``'s last resort,
taken where neither Mosaic nor Triton admits a plan, and said so in ``kernel.refused``."""

from __future__ import annotations

from lowering._plan import Plan
from lowering.xla._kernel import XlaConfig, XlaLowered
from napkin_cat.diagram import Diagram
from napkin_cat.hardware import Hardware


class Xla:
    """Plain JAX compiled by XLA (:class:`XlaLowered`): available on every device, and admits every plan
    :func:`lowering.plan` makes (XLA places the blocks: no power-of-two, shared-memory or register limit).

    >>> XLA.available(None, None), XLA.heuristic(None), len(XLA.space(None))
    (None, XlaConfig(unroll=1, chunks=(), one_pass=False), 3)
    """

    name, title, when, config = "xla", "XLA", "XLA where neither admits the plan", XlaConfig
    eager, reads_whole, pads = False, False, True

    def available(self, interpret: bool | None, config) -> str | None:
        """Always: XLA compiles for whatever device JAX runs on, without Pallas."""
        return None

    def admit(self, p: Plan, *, interpret: bool | None, config) -> str | None:
        """Every plan: a tiled axis is padded, the streamed one ends on a shorter chunk, whole ones stay whole."""
        return None

    def heuristic(self, p: Plan) -> XlaConfig:
        """:meth:`XlaConfig.get_default`."""
        return XlaConfig.get_default(p)

    def space(self, p: Plan) -> tuple[XlaConfig, ...]:
        """One, two or four chunks per iteration of the streamed loop."""
        return tuple(XlaConfig(unroll=u) for u in (1, 2, 4))

    def chunks(self, d: Diagram, config, *, auto: bool) -> dict:
        """The backward's chunks: those ``config`` names by axis (:attr:`XlaConfig.chunks`), else
        FlashAttention-2's (:func:`lowering._backward.backward_of`'s own), and its ``one_pass`` where asked.

        >>> XLA.chunks(None, XlaConfig(chunks=(("v", 4096),)), auto=False), XLA.chunks(None, None, auto=False)
        ({'chunks': {'v': 4096}}, {})
        >>> XLA.chunks(None, XlaConfig(chunks=(("v", 4096),), one_pass=True), auto=False)
        {'chunks': {'v': 4096}, 'one_pass': True}
        """
        if not isinstance(config, XlaConfig):
            return {}
        return ({"chunks": dict(config.chunks)} if config.chunks else {}) | (
            {"one_pass": True} if config.one_pass else {}
        )

    def emit(self, p: Plan, *, interpret: bool | None, config, hardware: Hardware | None) -> XlaLowered:
        """An :class:`XlaLowered` (``interpret`` has no meaning for it: XLA always compiles)."""
        return XlaLowered(p, config=config, hardware=hardware)

    def prefer(self, kernel: XlaLowered, *, backward: bool) -> str | None:
        """None: ``"auto"`` reaches XLA only where the backends before it refused."""
        return None


#: the XLA backend, last in :data:`lowering._registry.REGISTRY`
XLA = Xla()
