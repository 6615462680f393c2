"""Lowering DeepSpeed-Ulysses (``rewrites.ulysses``, Jacobs et al. 2023) in :func:`lowering.lower_devices`.

It runs inside ``lower_devices``' ``shard_map``.

Each device holds a chunk of the sequence with every head. ``lax.all_to_all`` trades the chunks for a group of
``H/P`` heads over the whole sequence (split the heads, concatenate the sequence), the per-device kernel (``lower``
of the scheduled diagram, through the backend registry) runs on it, and a second ``all_to_all`` takes the output
back to sequence chunks. The padding of a ragged sequence is cut off between the two all-to-alls, so the kernel
sees the true lengths (a causal mask and unequal query and key lengths are the kernel's own). The backward is the
kernel's lowered backward between the all-to-alls' transposes (all-to-alls the other way).

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream, ulysses
>>> from lowering import lower_devices
>>> h, q, x, d = nc.axes("h q x d")
>>> mha = nc.library.multi_head_attention(h, q, x, d, causal=True)
>>> kernel = lower_devices(ulysses("q", "x", "h", "sp", 1)(derive(mha, tile(q, 16), stream(x, 16), verify=False)))
>>> kernel.exchange, kernel.backends["forward"]
('all_to_all', 'triton')
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowering._plan import NotLowerable
from rewrites import Sharded, heads_refusal


def check_heads(s: Sharded, extent: dict) -> None:
    """A :class:`NotLowerable` naming the heads axis and the fix where the heads do not divide over the devices.

    >>> import napkin_cat as nc
    >>> from rewrites import Sequence
    >>> s = Sharded(nc.library.attention(*nc.axes("q x d")), (), Sequence("q", "x", "sp", 4, "all_to_all", heads="h"))
    >>> check_heads(s, {"h": 6})
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: lower_devices, ulysses over sp, axis 'h': 6 heads do not divide over 4 devices; \
use a device count that divides 6, or ring(q, x, sp, 4)
    """
    seq = s.sequence
    n = extent[seq.heads]
    if n % seq.devices:
        why = heads_refusal(seq.heads, n, seq.devices, seq.queries, seq.keys, seq.mesh_axis)
        raise NotLowerable(f"lower_devices, ulysses over {seq.mesh_axis}, axis {seq.heads!r}: {why}")


def ulysses_body(s: Sharded, kernel, lengths: tuple[int, int]):
    """The per-device function: all-to-all to head groups, the kernel on ``lengths`` (queries, keys) positions,
    all-to-all back to sequence chunks (padded as they came)."""
    seq, d = s.sequence, s.diagram
    out_w = d.cod.inside[0]
    length = dict(zip((seq.queries, seq.keys), lengths, strict=True))

    def seq_of(w) -> str:
        return seq.queries if w.has(seq.queries) else seq.keys

    def body(*xs):
        whole = []
        for w, x in zip(d.dom.inside, xs, strict=True):
            at = w.names.index(seq_of(w))
            x = jax.lax.all_to_all(x, seq.mesh_axis, w.names.index(seq.heads), at, tiled=True)
            whole.append(jax.lax.slice_in_dim(x, 0, length[seq_of(w)], axis=at))
        out = kernel(*whole)
        at = out_w.names.index(seq.queries)
        ins = zip(d.dom.inside, xs, strict=True)
        chunk = next(x.shape[w.names.index(seq.queries)] for w, x in ins if w.has(seq.queries))
        out = jnp.pad(out, [(0, chunk * seq.devices - n if i == at else 0) for i, n in enumerate(out.shape)])
        return jax.lax.all_to_all(out, seq.mesh_axis, at, out_w.names.index(seq.heads), tiled=True)

    if not all(w.has(seq.heads) for w in (*d.dom.inside, out_w)):
        raise NotLowerable(f"lower_devices, ulysses over {seq.mesh_axis}: every input and the output need {seq.heads}")
    return body


__all__ = ["check_heads", "ulysses_body"]
