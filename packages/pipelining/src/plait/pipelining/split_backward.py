"""Split backward: input gradients now (I), weight gradients later (W), without recomputing the graph twice.

The I pass asks autograd only for the stage inputs' gradients; hooks record the gradients that enter the
nodes where weight-only branches leave the input path ("intermediates"). The W pass restarts autograd from
those nodes with the recorded gradients and asks for the parameters only. plait's autograd Functions read
the kernels' grad-direction switch and skip the gradients the current pass does not need.

A ``torch.compile`` region's backward is one autograd node that computes every gradient of the region at
once (a compiled decoder layer's input and weight gradients come out of one graph). Splitting it would run
that node twice, once per pass; so when weights join the input path at such a node, the I pass is the
whole backward (its weight gradients kept) and the W pass only accumulates them into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from plait.kernels.grad_direction import GradDirection, grad_direction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradWork", "backward_input", "backward_weight"]


@dataclass
class WeightGradWork:
    """What the W pass needs: the recorded intermediate gradients and the roots W must start from itself."""

    params: list[torch.Tensor]
    intermediates: list[Node]
    # per intermediate: indices into params of the weights whose branch joins the input path there; None if
    # a weight joins at several intermediates (a weight used twice), which needs the single-pass W
    branches: list[list[int]] | None = None
    grads: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # index into intermediates -> grads in
    extra_roots: list[torch.Tensor] = field(default_factory=list)  # outputs not on the input path
    extra_grads: list[torch.Tensor | None] = field(default_factory=list)
    # the weight gradients of an I pass that was the whole backward (a compiled region on the input path)
    done: list[torch.Tensor | None] | None = None
    # The outputs keep the graph alive until W: the Python object of an autograd Function's node holds its
    # C++ node only weakly (torch 2.11), so once the caller drops the outputs the W pass would find them freed.
    outputs: list[torch.Tensor] = field(default_factory=list)


def _node(t: torch.Tensor) -> Node | None:
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


def _graph_parents(root_nodes: list[Node]) -> tuple[dict[Node, list[Node]], set[Node]]:
    """Each node's consumers (the nodes it feeds), and every node reachable from the roots."""
    parents: dict[Node, list[Node]] = {}
    stack, seen = list(root_nodes), set(root_nodes)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return parents, seen


def _input_path(in_nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes on a path from an output to a stage input."""
    closure, stack = set(in_nodes), list(in_nodes)
    while stack:
        for p in parents.get(stack.pop(), []):
            if p not in closure:
                closure.add(p)
                stack.append(p)
    return closure


def _branch_joins(pn: Node, parents: dict[Node, list[Node]], closure: set[Node]) -> set[Node]:
    """The nodes of the input path where the weight-only branch starting at ``pn`` joins it."""
    stack, visited, joins = [pn], {pn}, set()
    while stack:
        node = stack.pop()
        for p in parents.get(node, []):
            if p in closure:
                joins.add(p)
            elif p not in visited:
                visited.add(p)
                stack.append(p)
    return joins


def _intermediates(
    weights: list[torch.Tensor], parents: dict[Node, list[Node]], seen: set[Node], closure: set[Node]
) -> tuple[dict[Node, list[int]], bool]:
    """Where each weight's branch joins the input path, and whether a weight joins at several nodes."""
    inter: dict[Node, list[int]] = {}
    shared = False
    for i, prm in enumerate(weights):
        pn = _node(prm)
        if pn is None or pn not in seen:
            continue
        joins = _branch_joins(pn, parents, closure)
        shared |= len(joins) > 1
        for p in joins:
            inter.setdefault(p, []).append(i)
    return inter, shared


def _compiled_region(node: Node) -> bool:
    """``torch.compile``'s backward of a region: one node whose gradients all come out of one graph."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _grads(
    roots: list[tuple[torch.Tensor, torch.Tensor | None]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    direction: GradDirection,
    retain_graph: bool,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Gradients of ``roots`` w.r.t. the inputs that require them (None for the others) and ``params``."""
    want = [i for i, t in enumerate(inputs) if t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not roots or not (want or params):
        return result, [None] * len(params)
    with grad_direction(direction):
        got = torch.autograd.grad(
            [o for o, _ in roots],
            [inputs[i] for i in want] + list(params),
            grad_outputs=[g for _, g in roots],
            retain_graph=retain_graph,
            allow_unused=True,
        )
    for i, g in zip(want, got):
        result[i] = g
    return result, list(got[len(want) :])


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradWork]:
    """Gradients of `outputs` (weighted by `grad_outputs`) w.r.t. `inputs`; prepares the W pass.

    Returns:
        per-input gradients (None where an input does not require grad or is unused) and the W-pass work.
    """
    roots = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    parents, seen = _graph_parents([n for o, _ in roots if (n := _node(o)) is not None])
    closure = _input_path([n for t in inputs if (n := _node(t)) is not None and n in seen], parents)
    weights = [p for p in params if p.requires_grad]
    inter, shared = _intermediates(weights, parents, seen, closure)
    if any(_compiled_region(node) for node in inter):  # the I pass is the whole backward, W adds it up
        work = WeightGradWork(weights, [])
        result, work.done = _grads(roots, inputs, weights, GradDirection.BOTH, retain_graph=False)
        return result, work
    work = WeightGradWork(weights, list(inter), None if shared else list(inter.values()))
    work.outputs = [o for o, _ in roots]
    for o, g in roots:
        n = _node(o)
        if n is not None and n not in closure:
            work.extra_roots.append(o)
            work.extra_grads.append(g)

    def hook_for(i: int):  # type: ignore[no-untyped-def]
        def hook(grads_in: tuple[Any, ...]) -> None:
            work.grads[i] = tuple(g.detach() if g is not None else None for g in grads_in)

        return hook

    handles = [node.register_prehook(hook_for(i)) for i, node in enumerate(work.intermediates)]
    try:
        on_path = [(o, g) for o, g in roots if _node(o) in closure]
        result, _ = _grads(on_path, inputs, [], GradDirection.INPUTS, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return result, work


def _recorded_edges(work: WeightGradWork, i: int) -> list[tuple[GradientEdge, torch.Tensor]]:
    """The gradients the I pass recorded entering intermediate ``i``, with their edges."""
    node = work.intermediates[i]
    return [(GradientEdge(node, j), g) for j, g in enumerate(work.grads.get(i, ())) if g is not None]


def _weight_grads_per_branch(work: WeightGradWork, branches: list[list[int]]) -> list[torch.Tensor | None]:
    """One autograd call per intermediate, asking only for the weights of its own branch.

    Autograd then runs only that branch. (One call for all would also follow the input path from each
    intermediate down to earlier weights, recomputing every activation gradient of the I pass.)
    """
    dws: list[torch.Tensor | None] = [None] * len(work.params)
    with grad_direction(GradDirection.WEIGHTS):
        for i in range(len(work.intermediates)):
            edges = _recorded_edges(work, i)
            if not edges:
                continue
            got = torch.autograd.grad(
                [e for e, _ in edges],
                [work.params[k] for k in branches[i]],
                grad_outputs=[g for _, g in edges],
                allow_unused=True,
                retain_graph=bool(work.extra_roots),
            )
            for k, g_k in zip(branches[i], got):
                dws[k] = g_k
    return dws


def _weight_grads_single_pass(work: WeightGradWork) -> list[torch.Tensor | None]:
    """One autograd call from every intermediate (a weight joins the input path at several nodes)."""
    edges = [e for i in range(len(work.intermediates)) for e in _recorded_edges(work, i)]
    handles = []
    if len(work.intermediates) > 1:
        # An intermediate downstream of another would receive the upstream one's contribution a second
        # time; pin every intermediate's incoming gradients to what the I pass recorded.
        for i, node in enumerate(work.intermediates):
            recorded = work.grads.get(i)
            if recorded is not None:
                handles.append(node.register_prehook(lambda _g, rec=recorded: rec))
    try:
        with grad_direction(GradDirection.WEIGHTS):
            return list(
                torch.autograd.grad(
                    [e for e, _ in edges],
                    work.params,
                    grad_outputs=[g for _, g in edges],
                    allow_unused=True,
                    retain_graph=bool(work.extra_roots),
                )
            )
    finally:
        for h in handles:
            h.remove()


def _accumulate(params: list[torch.Tensor], dws: list[torch.Tensor | None]) -> None:
    for p, dw in zip(params, dws):
        if dw is None:
            continue
        if p.grad is None:
            p.grad = dw.detach().clone() if dw.requires_grad else dw
        else:
            p.grad += dw


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the parameters' gradients into ``param.grad`` from a finished :func:`backward_input`.

    Gradients recorded at the intermediates are propagated to the parameters under
    ``GradDirection.WEIGHTS``. Outputs off the input path (all outputs of a stage whose inputs need no
    gradient, e.g. the first stage) are backpropagated here in full under ``GradDirection.BOTH``: their
    activation gradients were never computed, and the earlier layers' weights need them.
    """
    if not work.params:
        return
    if work.done is not None:
        _accumulate(work.params, work.done)
        work.done = None
        return
    has_roots = any(_recorded_edges(work, i) for i in range(len(work.intermediates)))
    dws: list[torch.Tensor | None] = [None] * len(work.params)
    if has_roots and work.branches is not None:
        dws = _weight_grads_per_branch(work, work.branches)
    elif has_roots:
        dws = _weight_grads_single_pass(work)
    if work.extra_roots:
        more = torch.autograd.grad(
            work.extra_roots, work.params, grad_outputs=work.extra_grads, allow_unused=True
        )
        dws = [a if b is None else b if a is None else a + b for a, b in zip(dws, more)]
    _accumulate(work.params, dws)
    work.grads.clear()
    work.intermediates.clear()
    work.extra_roots.clear()
    work.extra_grads.clear()
    work.outputs.clear()
