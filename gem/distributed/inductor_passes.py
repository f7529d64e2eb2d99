"""Inductor graph passes for gem's compiled dense archs (``experimental.parallelism.scatter_in_place``,
``experimental.parallelism.residual_addmm``).

The backward of a row gather ``h[idx]`` (the sequence summaries' CLS and recent rows,
``kernels.jagged.jagged_first`` / ``jagged_last``) is ``index_put(zeros_like(h), [idx], grad,
accumulate=True)``: a gradient of the whole stream, zeros but for the gathered rows, which autograd
then adds to the stream's other gradient. Inductor keeps it as written, so every gather costs a
pass that fills ``[T, D]`` zeros and a pass that reads them back (docs/e2e.md).
:class:`ScatterAddInPlace` rewrites ``add(dense, index_put(zeros, [idx], values, True))`` to
``index_put(dense, [idx], values, True)`` where the sum is ``dense``'s only use, which Inductor's
reinplacing then turns into a scatter into ``dense`` itself. Each element gets the same sum where
no index repeats (``dense + value`` or ``dense + 0``); a repeated index, or several scatters
summed before the add, add their values onto ``dense`` one at a time instead of summing them
first, which can round differently.

Without biases on the row projections (``model.row_bias=false``) Inductor's own post-grad pattern
turns a residual add ``residual + x @ W`` into ``addmm(residual, x, W)``, and ATen's ``addmm``
first copies ``residual`` into its output, for cuBLAS to add the product to it: a copy of the
stream per projection (on the flagship 0.76 ms a step, docs/e2e.md). :class:`AddAfterMatmul` turns
each such ``addmm`` of a full-size addend back into ``mm`` then ``add``, which Inductor fuses into
the kernel that reads the sum (a LayerNorm), as it did with the biases; a bias (a broadcast row)
stays on cuBLAS's epilogue. The product is rounded to its dtype before the add, as in eager mode.
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
logger = logging.getLogger(__name__)


def _zeros_like(node: torch.fx.Node, like: torch.Tensor) -> bool:
    """Whether ``node`` makes a tensor of zeros of ``like``'s shape and dtype."""
    if not isinstance(node, torch.fx.Node) or node.target not in (aten.full.default, aten.zeros.default):
        return False
    if node.target is aten.full.default and node.args[1] != 0:
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.shape == like.shape and val.dtype == like.dtype


def _accumulating_scatter(node) -> bool:
    """Whether ``node`` is ``index_put(base, indices, values, accumulate=True)``, used once."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.index_put.default or len(node.users) != 1:
        return False
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return bool(accumulate) and isinstance(node.meta.get("val"), torch.Tensor)


def _scatters_into_zeros(node) -> list[torch.fx.Node]:
    """The scatters, innermost first, where ``node`` is a chain of accumulating scatters, each used
    only by the next, that starts from zeros of its shape and dtype (the gradients of several
    gathers from one tensor, summed); else an empty list."""
    chain = []
    while _accumulating_scatter(node):
        chain.append(node)
        node = node.args[0]
    if not chain or not _zeros_like(node, chain[-1].meta["val"]):
        return []
    return chain[::-1]


class ScatterAddInPlace(CustomGraphPass):
    """``add(dense, index_put(zeros, [idx], values, accumulate=True))`` -> ``index_put(dense, [idx],
    values, accumulate=True)``, also where the scatter is a chain of them from zeros, for a
    ``dense`` of the sum's shape and dtype that nothing else uses (a post-grad pass:
    ``torch._inductor.config.post_grad_custom_pre_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewritten = 0
        for node in list(graph.nodes):
            if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
                continue
            out = node.meta.get("val")
            for dense, scatter in (node.args, node.args[::-1]):
                chain = _scatters_into_zeros(scatter)
                if not chain or not isinstance(dense, torch.fx.Node) or dense in chain or dense.op == "placeholder":
                    continue  # (Inductor would copy a graph input to scatter into)
                if len(dense.users) != 1:
                    continue  # (and a tensor used elsewhere too)
                dense_val, scatter_val = dense.meta.get("val"), scatter.meta["val"]
                if not (
                    isinstance(dense_val, torch.Tensor)
                    and isinstance(out, torch.Tensor)
                    and dense_val.shape == out.shape == scatter_val.shape
                    and dense_val.dtype == out.dtype == scatter_val.dtype
                ):
                    continue
                zeros = chain[0].args[0]
                chain[0].replace_input_with(zeros, dense)
                for link in chain:  # after dense, which the graph may compute after the scatters
                    node.prepend(link)
                node.replace_all_uses_with(scatter)
                graph.erase_node(node)
                if not zeros.users:
                    graph.erase_node(zeros)
                rewritten += 1
                break
        if rewritten:
            logger.info("scatter_in_place: %d gathers' gradients scattered into the gradient they add to", rewritten)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _full_size_addend(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``addmm(inp, a, b)`` with alpha = beta = 1 and an ``inp`` of the
    output's shape and dtype that is not a broadcast (no stride of 0, as an expanded bias has)."""
    if node.target is not aten.addmm.default or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
        return False
    inp, out = node.args[0], node.meta.get("val")
    inp = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    return (
        isinstance(inp, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and inp.shape == out.shape
        and inp.dtype == out.dtype
        and 0 not in inp.stride()
    )


class AddAfterMatmul(CustomGraphPass):
    """``addmm(inp, a, b)`` of a full-size ``inp`` -> ``add(mm(a, b), inp)`` (a post-grad pass that
    runs after Inductor's patterns: ``torch._inductor.config.post_grad_custom_post_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewritten = 0
        for node in list(graph.nodes):
            if not _full_size_addend(node):
                continue
            inp, a, b = node.args[:3]
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (a, b))
                total = graph.call_function(aten.add.Tensor, (product, inp))
            product.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
            total.meta["val"] = aten.add.Tensor(product.meta["val"], inp.meta["val"])
            node.replace_all_uses_with(total)
            graph.erase_node(node)
            rewritten += 1
        if rewritten:
            logger.info("residual_addmm=false: %d full-size addends taken out of addmm", rewritten)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
