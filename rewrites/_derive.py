"""Derivations: a diagram and the sequence of verified relabellings applied to it.

``derive(d, *rules)`` applies each rule in turn (its side conditions are the first line of defence)
and verifies every step against the original diagram's reference semantics on one random trial
(``rewrites._verify``): the same sizes and inputs for every step, drawn from a seed the derivation
records. ``verify="kernel"`` also lowers the final diagram and checks the kernel on that trial, so
"verified" covers what the user runs. The final diagram is the *scheduled diagram* the lowering consumes.

Sizes a rule leaves open (``tile(q)``, ``stream(x, "auto")``) stay symbols in the steps' diagrams (their
cost and pseudocode are sympy in ``g_q``, ``s_x``); the checks bind them to small sizes drawn from the seed
(16 under ``verify="kernel"``, the smallest block a kernel takes), or to ``sizes={"g_q": ...}``, and
record them with the other sizes. ``lowering.lower`` resolves them for the hardware.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 8), seed=0)
>>> [str(s.rule) for s in flash.steps]
['original', 'tile(q, 16)', 'stream(x, 8)']
>>> all(s.verification.passed for s in flash.steps[1:]), flash.seed
(True, 0)
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import jax

from napkin_cat.diagram import Diagram
from rewrites._rule import RewriteError, Rule, open_sizes, positive_size, resolve
from rewrites._verify import FAST_COMPILE, Trial, Verification, bound, matmul_format

VERIFY = (True, False, "kernel")


@dataclass(frozen=True)
class Step:
    """One step: the rule applied (or the starting diagram's name), the diagram after it, its check.

    >>> import napkin_cat as nc
    >>> print(Step("original", nc.library.attention(*nc.axes("q x d"))))
    original: the starting diagram
    """

    rule: Rule | str
    diagram: Diagram
    verification: Verification | None = None

    def __str__(self):
        return f"{self.rule}: {self.verification or 'the starting diagram'}"


@dataclass(frozen=True)
class Derivation:
    """A verified derivation; ``.diagram`` is its scheduled diagram, ``.seed`` replays its checks, and
    ``.kernel`` is the check of the lowered kernel (with ``verify="kernel"``).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile
    >>> q, x, d = nc.axes("q x d")
    >>> tiled = derive(nc.library.attention(q, x, d), tile(q, 4), seed=5)
    >>> print(tiled.diagram.cod), tiled.original == nc.library.attention(q, x, d)
    q/4×d
    (None, True)
    """

    steps: tuple[Step, ...] = field(default_factory=tuple)
    seed: int | None = None
    kernel: Verification | None = None

    @property
    def diagram(self) -> Diagram:
        """The scheduled diagram: the last step's (what the lowering consumes).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> q, x, d = nc.axes("q x d")
        >>> print(derive(nc.library.attention(q, x, d), tile(q, 8), verify=False).diagram.cod)
        q/8×d
        """
        return self.steps[-1].diagram

    @property
    def original(self) -> Diagram:
        """The diagram the derivation started from.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> attn = nc.library.attention(*nc.axes("q x d"))
        >>> derive(attn, tile("q", 8), verify=False).original == attn
        True
        """
        return self.steps[0].diagram

    def then(
        self, *rules: Rule, verify: bool | str = True, seed: int | None = None, sizes: dict | None = None
    ) -> Derivation:
        """This derivation extended by more rules, verified as :func:`derive` does (``seed`` defaults to
        this derivation's).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d), tile(q, 4), seed=1).then(stream(x, 4))
        >>> print(flash.steps[-1].rule, flash.seed)
        stream(x, 4) 1
        """
        if verify not in VERIFY:
            raise RewriteError("derive", f"verify must be True, False or 'kernel', got {verify!r}")
        _check_rules(rules)
        seed = (self.seed if self.seed is not None else _fresh_seed()) if seed is None else seed
        diagrams, last = [], self.diagram
        for rule in rules:  # every side condition first: an unsound step is refused before any evaluation
            last = rule(last)
            diagrams.append(last)
        if not verify or not rules:
            return Derivation((*self.steps, *map(Step, rules, diagrams)), seed)
        chosen, sizes = _open_for_check(last, seed, sizes, kernel=verify == "kernel")
        last = resolve(last, chosen)
        trial = Trial.draw(self.original, last, seed=seed, sizes=sizes, rule="derive")
        trial = replace(trial, sizes={**trial.sizes, **chosen})
        checked = [trial.resize(resolve(new, chosen)) for new in diagrams]  # resized once: compiled once
        program, failure = None, None
        if verify == "kernel":
            # the steps' checks compile while the kernel is lowered and traced (XLA compiles release the GIL); the
            # steps are then checked first, as in order, so a failing step is reported before the kernel's error
            with ThreadPoolExecutor(1) as compiler:
                ahead = [_compiling(compiler, trial, c) for c in checked]
                try:
                    program = _kernel_program(trial, last)
                except Exception as e:  # noqa: BLE001 - raised below, after the steps' checks
                    failure = e
                for f in filter(None, ahead):
                    f.exception()  # done (a program that does not compile fails again in its check, in order)
        steps = [
            Step(rule, new, trial.check(c, repr(rule))) for rule, new, c in zip(rules, diagrams, checked, strict=True)
        ]
        if failure is not None:
            raise failure
        kernel = _check_kernel(trial, last, program) if verify == "kernel" else None
        return Derivation((*self.steps, *steps), seed, kernel)

    def cost(self, hardware=None):
        """The cost of each step's diagram (``napkin_cat._cost``), as a list.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> q, x, d = nc.axes("q x d")
        >>> len(derive(nc.library.attention(q, x, d), tile(q, 4), verify=False).cost())
        2
        """
        from napkin_cat import cost

        return [cost(s.diagram, hardware) if hardware is not None else cost(s.diagram) for s in self.steps]

    def pseudocode(self) -> str:
        """The expanded loop program of the scheduled diagram (FAN §5).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> q, x, d = nc.axes("q x d")
        >>> "for" in derive(nc.library.attention(q, x, d), tile(q, 4), verify=False).pseudocode()
        True
        """
        from rewrites._pseudocode import pseudocode

        return pseudocode(self.diagram)

    def draw(self, path: str, **kwargs):
        """The derivation as a sequence of pictures, one per step, titled by its rule (see
        ``napkin_cat.draw_sequence``), written to ``path``.

        >>> import os, tempfile
        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> q, x, d = nc.axes("q x d")
        >>> path = os.path.join(tempfile.mkdtemp(), "tiled.png")
        >>> _ = derive(nc.library.attention(q, x, d), tile(q, 4), verify=False).draw(path)
        >>> os.path.exists(path)
        True
        """
        from napkin_cat.drawing import draw_sequence

        return draw_sequence([s.diagram for s in self.steps], path, titles=[str(s.rule) for s in self.steps], **kwargs)

    def __str__(self):
        lines = [f"{i}. {s}" for i, s in enumerate(self.steps)]
        return "\n".join(lines + ([f"kernel: {self.kernel}"] if self.kernel is not None else []))


#: the rules a user most likely meant, for error messages
EXAMPLES = "tile('q', 64), stream('x', 64), split('q', 2), level(nc.SMEM) (from rewrites)"


def _check_rules(rules) -> None:
    """Refuse anything that is not a :class:`Rule` (a rule's name as a string, the rule class uncalled),
    naming its position and what to pass."""
    for i, rule in enumerate(rules):
        if isinstance(rule, Rule):
            continue
        if isinstance(rule, type) and issubclass(rule, Rule):
            raise RewriteError(
                "derive",
                f"rule {i} is the class {rule.__name__}; call it with its arguments: "
                f"{rule.__name__}(...), e.g. {EXAMPLES}",
            )
        if isinstance(rule, str):
            fix = f"pass the rule itself, not its name: e.g. {EXAMPLES}"
        else:
            fix = f"pass rules such as {EXAMPLES}"
        raise RewriteError("derive", f"rule {i} is {type(rule).__name__} {_short(rule)}, not a Rule; {fix}")


def _check_diagram(d) -> None:
    """Refuse a starting point that is not a diagram; a derivation is extended with ``.then``."""
    if isinstance(d, Diagram):
        return
    if isinstance(d, Derivation):
        raise RewriteError("derive", "got a Derivation to start from; extend it with derivation.then(*rules)")
    raise RewriteError(
        "derive",
        f"expected a napkin_cat Diagram to start from, got {type(d).__name__} {_short(d)}; "
        "pass a diagram such as nc.library.attention(q, x, d)",
    )


def _short(x, width: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= width else text[: width - 1] + "…"


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _open_for_check(d: Diagram, seed: int, sizes: dict | None, kernel: bool) -> tuple[dict, dict | None]:
    """Sizes for ``d``'s open partition sizes in a check (``sizes`` by symbol name, else drawn from ``seed``:
    small, so that several groups and chunks run), and ``sizes`` without them."""
    opens = {o.symbol.name: o for o in open_sizes(d)}
    fixed = {a.name: int(a.size) for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.size.is_number}
    given = {k: v for k, v in (sizes or {}).items() if str(k) in opens}
    rest = {k: v for k, v in (sizes or {}).items() if str(k) not in opens} if sizes is not None else None
    rng = random.Random(seed)
    chosen = {}
    for name, o in opens.items():
        if name in given:
            chosen[name] = positive_size("derive", f"the size of {o}", given[name], o.axis)
        else:
            top = fixed.get(o.axis, 16)  # a concretely sized axis bounds its partition
            chosen[name] = min(16, top) if kernel else rng.choice([n for n in (4, 8, 16) if n <= top] or [top])
    return chosen, rest


def _compiling(compiler: ThreadPoolExecutor, trial: Trial, candidate: Diagram):
    """``candidate``'s check program compiling in ``compiler``, or None where tracing it fails: its check, in order,
    raises that again."""
    try:
        program = trial.program(candidate)
    except Exception:  # noqa: BLE001 - raised again by its check
        return None
    return compiler.submit(program.compile)


def _kernel_program(trial: Trial, scheduled: Diagram):
    """``scheduled`` lowered (:func:`lowering.lower`), its kernel traced and lowered for ``trial``'s inputs, to be
    compiled: as fast as the other checks compile (run once); the kernel inside is the same program."""
    from lowering import lower  # the lowering depends on rewrites, not the other way round

    kernel = lower(trial.resize(scheduled))
    return jax.jit(kernel, compiler_options=FAST_COMPILE).trace(*trial.inputs).lower()


def _check_kernel(trial: Trial, scheduled: Diagram, program=None) -> Verification:
    """Lower ``scheduled`` and compare the kernel with the reference on ``trial``'s inputs (``program``:
    :func:`_kernel_program`'s, if already made). The kernel runs at the matmul precision its user gets (on a GPU by
    default, f32 operands rounded to TF32), so the tolerance is that of the format its matmuls round to, where
    coarser than its wires'."""
    program = _kernel_program(trial, scheduled) if program is None else program
    start = time.perf_counter()
    got = jax.block_until_ready(program.compile()(*trial.inputs))
    seconds = time.perf_counter() - start
    tol, basis = bound(scheduled, matmul_format())
    return trial.compare(got, tol, seconds, "derive(verify='kernel')", "the lowered kernel", basis=basis)


def derive(
    d: Diagram,
    *rules: Rule,
    name: str | None = None,
    seed: int | None = None,
    sizes: dict | None = None,
    verify: bool | str = True,
) -> Derivation:
    """Apply ``rules`` to ``d`` in order, then verify each step (see :mod:`rewrites._verify`).

    ``seed`` (drawn from the OS if None) is recorded in the derivation and in every check, and printed
    in any failure; ``sizes`` fixes sizes by axis name (the others are drawn so that every tile and
    stream is ragged). ``verify=False`` only checks the side conditions; ``verify="kernel"`` also lowers
    the result (``lowering.lower``; interpreted on CPU) and checks the kernel on the same inputs.

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), sizes={"d": 8}, verify="kernel")
    >>> flash.kernel.passed, flash.kernel.sizes["d"]
    (True, 8)
    """
    _check_diagram(d)
    return Derivation((Step(name or "original", d),), seed).then(*rules, verify=verify, sizes=sizes)
