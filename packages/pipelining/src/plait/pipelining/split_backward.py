"""Split backward: input gradients now (I), weight gradients later (W), without recomputing the graph twice.

The I pass asks autograd only for the stage inputs' gradients; hooks record the gradients that enter the
nodes where weight-only branches leave the input path ("intermediates"). The W pass restarts autograd from
those nodes with the recorded gradients and asks for the parameters only. plait's autograd Functions read
the kernels' grad-direction switch and skip the gradients the current pass does not need.
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
    # The outputs keep the graph alive until W: the Python object of an autograd Function's node holds its
    # C++ node only weakly (torch 2.11), so once the caller drops the outputs the W pass would find them freed.
    outputs: list[torch.Tensor] = field(default_factory=list)


def _node(t: torch.Tensor) -> Node | None:
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


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
    root_nodes = [n for o, _ in roots if (n := _node(o)) is not None]
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
    # nodes on a path from an output to a stage input
    in_nodes = [n for t in inputs if (n := _node(t)) is not None and n in seen]
    closure, stack = set(in_nodes), list(in_nodes)
    while stack:
        for p in parents.get(stack.pop(), []):
            if p not in closure:
                closure.add(p)
                stack.append(p)
    # intermediates: where a weight's branch joins the input path
    weights = [p for p in params if p.requires_grad]
    inter: dict[Node, list[int]] = {}
    shared = False
    for i, prm in enumerate(weights):
        pn = _node(prm)
        if pn is None or pn not in seen:
            continue
        stack, visited, joins = [pn], {pn}, set()
        while stack:
            node = stack.pop()
            for p in parents.get(node, []):
                if p in closure:
                    joins.add(p)
                elif p not in visited:
                    visited.add(p)
                    stack.append(p)
        shared |= len(joins) > 1
        for p in joins:
            inter.setdefault(p, []).append(i)
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
        want = [i for i, t in enumerate(inputs) if t.requires_grad]
        on_path = [(o, g) for o, g in roots if _node(o) in closure]
        result: list[torch.Tensor | None] = [None] * len(inputs)
        if want and on_path:
            with grad_direction(GradDirection.INPUTS):
                got = torch.autograd.grad(
                    [o for o, _ in on_path],
                    [inputs[i] for i in want],
                    grad_outputs=[g for _, g in on_path],
                    retain_graph=True,
                    allow_unused=True,
                )
            for i, g in zip(want, got):
                result[i] = g
    finally:
        for h in handles:
            h.remove()
    return result, work


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the parameters' gradients into ``param.grad`` from a finished :func:`backward_input`.

    Gradients recorded at the intermediates are propagated to the parameters under
    ``GradDirection.WEIGHTS``. Outputs off the input path (all outputs of a stage whose inputs need no
    gradient, e.g. the first stage) are backpropagated here in full under ``GradDirection.BOTH``: their
    activation gradients were never computed, and the earlier layers' weights need them.
    """
    roots: list[Any] = []
    grads: list[torch.Tensor | None] = []
    for i, node in enumerate(work.intermediates):
        for j, g in enumerate(work.grads.get(i, ())):
            if g is not None:
                roots.append(GradientEdge(node, j))
                grads.append(g)
    if not work.params:
        return
    dws: list[torch.Tensor | None] = [None] * len(work.params)
    if roots and work.branches is not None:
        # One autograd call per intermediate, asking only for the weights of its own branch: autograd then
        # runs only that branch. (One call for all would also follow the input path from each intermediate
        # down to earlier weights, recomputing every activation gradient of the I pass.)
        with grad_direction(GradDirection.WEIGHTS):
            for i, node in enumerate(work.intermediates):
                edges = [
                    (GradientEdge(node, j), g) for j, g in enumerate(work.grads.get(i, ())) if g is not None
                ]
                if not edges:
                    continue
                branch = work.branches[i]
                got = torch.autograd.grad(
                    [e for e, _ in edges],
                    [work.params[k] for k in branch],
                    grad_outputs=[g for _, g in edges],
                    allow_unused=True,
                    retain_graph=bool(work.extra_roots),
                )
                for k, g_k in zip(branch, got):
                    dws[k] = g_k
    elif roots:
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
                dws = list(
                    torch.autograd.grad(
                        roots,
                        work.params,
                        grad_outputs=grads,
                        allow_unused=True,
                        retain_graph=bool(work.extra_roots),
                    )
                )
        finally:
            for h in handles:
                h.remove()
    if work.extra_roots:
        more = torch.autograd.grad(
            work.extra_roots, work.params, grad_outputs=work.extra_grads, allow_unused=True
        )
        dws = [a if b is None else b if a is None else a + b for a, b in zip(dws, more)]
    for p, dw in zip(work.params, dws):
        if dw is None:
            continue
        if p.grad is None:
            p.grad = dw.detach().clone() if dw.requires_grad else dw
        else:
            p.grad += dw
    work.grads.clear()
    work.intermediates.clear()
    work.extra_roots.clear()
    work.extra_grads.clear()
    work.outputs.clear()
