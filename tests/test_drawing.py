"""Drawing: files are produced, carry the level colours and axis labels, are deterministic; TikZ is well formed;
the architectures of Neural Circuit Diagrams fit a page at a readable size."""

import re
import struct

import pytest
from matplotlib.colors import to_hex

import napkin_cat as nc
from napkin_cat import architectures as arch
from napkin_cat import generators as g
from napkin_cat import library
from napkin_cat.diagram import Copy, Discard, Ty
from napkin_cat.drawing import DPI, Shape, dataflow, draw, draw_equation, draw_sequence, family, layout, wire_label
from napkin_cat.drawing._layout import rows
from napkin_cat.errors import NapkinError
from napkin_cat.levels import HBM, REG, SMEM

b, h, q, x, d = nc.axes("b h q x d")


def partitioned(a: nc.Array, level=None) -> nc.Array:
    axes = [ax.tiled(128) if ax.name == "q" else ax.streamed(64) if ax.name == "x" else ax for ax in a.axes]
    return a.with_(axes=axes, level=level)


def scheduled() -> nc.Diagram:
    """Attention with q tiled, x streamed, operands loaded to SMEM, scores in registers, the output stored."""
    attn = library.attention(q, x, d).map_arrays(lambda a: partitioned(a, SMEM))
    Q, K, V = attn.dom.inside
    loads = g.move(Q.with_(level=HBM), SMEM) @ g.move(K.with_(level=HBM), SMEM) @ g.move(V.with_(level=HBM), SMEM)
    S = attn.boxes[0].cod.inside[0]
    scores = (attn.boxes[0] @ nc.id(V)) >> (g.move(S, REG) @ nc.id(V))
    softmax = g.softmax(S.with_(level=REG), x) >> g.move(S.with_(level=REG), SMEM)
    return loads >> scores >> (softmax @ nc.id(V)) >> attn.boxes[-1] >> g.move(attn.cod.inside[0], HBM)


DIAGRAMS = {
    "attention": library.attention(q, x, d),
    "mha": library.multi_head_attention(h, q, x, d, batch=(b,), dtype=nc.bf16),
    "causal": library.attention(q, x, d, causal=True),
    "scheduled": scheduled(),
}


def svg_of(diagram, tmp_path, name="d.svg") -> str:
    draw(diagram, tmp_path / name)
    return (tmp_path / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", DIAGRAMS)
@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf", ".tex"])
def test_files_are_produced(tmp_path, name, suffix):
    path = tmp_path / f"{name}{suffix}"
    draw(DIAGRAMS[name], path, title=name)
    assert path.stat().st_size > 2000


@pytest.mark.parametrize("name", DIAGRAMS)
def test_svg_has_level_colours_and_axis_labels(tmp_path, name):
    diagram = DIAGRAMS[name]
    svg = svg_of(diagram, tmp_path).lower()
    wires = [*diagram.dom.inside, *(a for box in diagram.boxes for a in box.cod.inside)]
    for level in {a.level for a in wires}:
        assert to_hex(level.colour) in svg, level
        assert level.name.lower() in svg  # the legend
    for ax in {ax for a in wires for ax in a.axes}:
        assert str(ax).lower() in svg, ax


def test_partition_labels_and_moves(tmp_path):
    svg = svg_of(DIAGRAMS["scheduled"], tmp_path)
    for label in ("q/128", "x~64", "HBM→SMEM", "SMEM→REG", "SMEM→HBM", "tiled in groups"):
        assert label in svg
    for level in (HBM, SMEM, REG):
        assert to_hex(level.colour) in svg


def test_dtype_shown_where_not_f32(tmp_path):
    assert "[bf16]" in svg_of(DIAGRAMS["mha"], tmp_path)
    assert "[f32]" not in svg_of(DIAGRAMS["attention"], tmp_path, "a.svg")


def test_families_have_distinct_shapes():
    S = nc.Array(q, x)
    boxes = [
        g.contract("q x, x d -> q d", q, x, d),
        g.exp(S),
        g.softmax(S, x),
        g.causal_mask(S, q, x),
        g.cast(S, "bf16"),
        g.move(S, SMEM),
        Copy(Ty(S), 2),
        Discard(Ty(S)),
        nc.swap(S, S).boxes[0],
    ]
    kinds = [family(box) for box in boxes]
    assert kinds == ["contraction", "elementwise", "reduction", "mask", "relabel", "move", "copy", "discard", "swap"]


def test_structural_boxes_draw(tmp_path):
    S = nc.Array(q, x)
    d_ = Copy(Ty(S), 2) >> (g.exp(S) @ Discard(Ty(S)))
    d_ = (d_ @ nc.id(nc.Array(d))) >> nc.swap(S, nc.Array(d))
    pic = layout(d_)
    assert pic.bounds()[2] > 1
    svg = svg_of(d_, tmp_path)
    assert "exp" in svg and to_hex("black") in svg


def test_tensored_loads_share_a_column():
    flow = dataflow(DIAGRAMS["scheduled"])
    loads = [n.column for n in flow.nodes if n.kind == "move"]
    assert loads[:3] == [0, 0, 0] and len(set(loads)) == 4  # three loads side by side, then three single moves


def test_swaps_are_absorbed_and_copies_branch():
    S, D = nc.Array(q, x), nc.Array(d)
    crossed = (g.exp(S) @ nc.id(D)) >> nc.swap(S, D) >> nc.swap(D, S)
    flow = dataflow(crossed)
    assert [n.kind for n in flow.nodes] == ["elementwise"] and len(flow.nets) == 3
    copied = nc.copy(S) >> (g.exp(S) @ nc.id(S))
    flow = dataflow(copied)
    assert [len(net.uses) for net in flow.nets] == [2, 1]  # one net, used twice
    assert sum(type(i).__name__ == "Dot" for i in layout(copied).items) == 1


def test_parameters_enter_from_above_and_weaving_stacks():
    n, i_, h_, o = nc.axes("n i h o")
    flow = dataflow(library.mlp(n, i_, h_, o))
    assert {wire_label(flow.nets[p].array) for p in flow.parameters} >= {"i·h", "h·o"}
    assert all(flow.nets[p].source is None for p in flow.parameters)
    mha = library.multi_head_attention(h, q, x, d)
    boxes = [i for i in layout(mha).items if isinstance(i, Shape) and len(i.points) == 4]
    assert len(boxes) == 2 * 3 + 1  # two contractions, each a stack of three, and the softmax


def test_svg_is_deterministic(tmp_path):
    a, b_ = (svg_of(DIAGRAMS["scheduled"], tmp_path, f"{n}.svg") for n in "ab")
    assert a == b_
    assert "<dc:date>" not in a


def test_png_is_deterministic(tmp_path):
    for n in "ab":
        draw(DIAGRAMS["causal"], tmp_path / f"{n}.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def _balanced(tex: str) -> bool:
    stack = []
    for kind, env in re.findall(r"\\(begin|end)\{(\w+)\}", tex):
        if kind == "begin":
            stack.append(env)
        elif not stack or stack.pop() != env:
            return False
    bare = tex.replace("\\{", "").replace("\\}", "")
    return not stack and bare.count("{") == bare.count("}")


@pytest.mark.parametrize("name", DIAGRAMS)
def test_tikz_is_well_formed(tmp_path, name):
    tex = draw(DIAGRAMS[name], to_tikz=True)
    assert _balanced(tex)
    assert tex.count("\\begin{tikzpicture}") == 1 and "\\draw[" in tex and "\\node[" in tex
    assert all(line.endswith(";") for line in tex.splitlines() if line.startswith(("\\draw", "\\fill", "\\node")))
    draw(DIAGRAMS[name], tmp_path / "d.tex")
    assert (tmp_path / "d.tex").read_text(encoding="utf-8") == tex


def test_tikz_colours_and_labels():
    tex = draw(DIAGRAMS["scheduled"], to_tikz=True)
    for level in (HBM, SMEM, REG):
        assert to_hex(level.colour)[1:].upper() in tex
    assert "q/128" in tex and "x$\\sim$64" in tex


def test_equation_and_sequence(tmp_path):
    attn = DIAGRAMS["attention"]
    tiled = attn.map_arrays(partitioned)
    draw_equation(attn, tiled, tmp_path / "eq.png", titles=("before", "after"))
    assert (tmp_path / "eq.png").stat().st_size > 5000
    svg = (
        draw_sequence([attn, tiled, scheduled()], tmp_path / "seq.svg", titles=["naive", "tiled", "loaded"]),
        (tmp_path / "seq.svg").read_text(encoding="utf-8"),
    )[1]
    assert all(t in svg for t in ("naive", "tiled", "loaded", "→", "q/128"))
    tex = draw_equation(attn, tiled, to_tikz=True, symbol="⇒")
    assert "\\Rightarrow" in tex and _balanced(tex)


def test_twenty_boxes_layout_is_linear():
    S = nc.Array(q, x)
    chain = nc.id(S)
    for i in range(20):
        chain = chain >> (g.exp(S) if i % 2 else g.scale(S, i + 1))
    pic = layout(chain)
    assert sum(isinstance(i, Shape) and len(i.points) == 4 for i in pic.items) == 20  # and arrowheads at cuts
    net_rows, node_rows = rows(dataflow(chain))
    assert set(net_rows.values()) == set(node_rows.values()) == {0}  # a chain runs straight


def test_wire_label():
    assert wire_label(nc.Array(q.tiled(128), x.streamed(64), d, dtype=nc.bf16)) == "q/128·x~64·d [bf16]"
    assert wire_label(nc.Array()) == "scalar"


@pytest.mark.parametrize(
    "path, message",
    [
        ("picture.jpg", "suffix must be one of"),
        ("picture", "got none"),
        ("missing/picture.png", "does not exist"),
        (".", "suffix"),
    ],
)
def test_bad_paths_raise(tmp_path, path, message):
    with pytest.raises(NapkinError, match=message):
        draw(DIAGRAMS["attention"], tmp_path / path)


def test_bad_arguments_raise(tmp_path):
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(NapkinError, match="is a directory"):
        draw(DIAGRAMS["attention"], tmp_path / "dir.png")
    with pytest.raises(NapkinError, match="must end in .tex"):
        draw(DIAGRAMS["attention"], tmp_path / "a.png", to_tikz=True)
    with pytest.raises(NapkinError, match="str or pathlib.Path"):
        draw(DIAGRAMS["attention"], 3)
    with pytest.raises(NapkinError, match="expected a napkin_cat Diagram"):
        draw("attention", tmp_path / "a.png")
    with pytest.raises(NapkinError, match="2 titles for 3 diagrams"):
        draw_sequence([DIAGRAMS["attention"]] * 3, titles=["a", "b"])
    with pytest.raises(NapkinError, match="no diagrams"):
        draw_sequence([])


def test_fallback_is_loud(tmp_path, monkeypatch):
    import napkin_cat.drawing as drawing

    def broken(_):
        raise ValueError("no room")

    monkeypatch.setattr(drawing, "layout", broken)
    with pytest.raises(ValueError, match="no room"):
        draw(DIAGRAMS["attention"], tmp_path / "a.png", fallback=False)
    with pytest.warns(RuntimeWarning, match="drawing it with discopy instead"):
        draw(DIAGRAMS["attention"], tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_long_derivations_wrap_into_rows(tmp_path):
    attn = DIAGRAMS["attention"]
    steps = [attn, attn.map_arrays(partitioned), scheduled(), attn]
    one = draw_sequence(steps, titles=["a", "b", "c", "d"], per_row=4)
    two = draw_sequence(steps, titles=["a", "b", "c", "d"], per_row=2)
    (w1, h1), (w2, h2) = one.get_size_inches(), two.get_size_inches()
    assert w2 < w1 * 0.7 and h2 > h1 * 1.5
    with pytest.raises(NapkinError, match="per_row must be a positive integer"):
        draw_sequence(steps, per_row=0)


def test_identities_and_twenty_boxes_draw(tmp_path):
    S = nc.Array(q, x)
    chain = nc.id(S)
    for i in range(20):
        chain = chain >> (g.exp(S) if i % 2 else g.scale(S, i + 1))
    for i, diagram in enumerate((nc.id(S), nc.id(), chain)):
        draw(diagram, tmp_path / f"{i}.png")
        assert (tmp_path / f"{i}.png").exists()


def png_width(path) -> int:
    return struct.unpack(">II", path.read_bytes()[16:24])[0]


ARCHITECTURES = {
    "transformer block": lambda: arch.transformer_block(*nc.axes("n d h k f")),
    "U-Net": lambda: arch.unet(*nc.axes("i w o"), nc.axes("x y"), depth=1),
    "ViT encoder block": lambda: arch.vit_encoder_block(arch.tokens(nc.axes("x y"), 16), *nc.axes("d h k f")),
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_architectures_fit_a_page_at_a_readable_size(tmp_path, name):
    fig = draw(ARCHITECTURES[name](), tmp_path / "a.png", title=name)
    assert png_width(tmp_path / "a.png") <= 2500  # was 13,334 px for the transformer block
    smallest = min(t.get_fontsize() for t in fig.axes[0].texts) * DPI / 72
    assert smallest >= 14  # pixels of type at the dpi the PNG is written at
