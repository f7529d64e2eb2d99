"""gem.distributed.inductor_passes: the post-grad rewrites that scatter a row gather's gradient into
the dense gradient it is added to (``experimental.parallelism.scatter_in_place``) and take a full-size addend
out of ``addmm`` (``experimental.parallelism.residual_addmm=false``), under Inductor on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

from gem.distributed.inductor_passes import AddAfterMatmul, ScatterAddInPlace
from kernels.jagged import jagged_first, jagged_last

aten = torch.ops.aten


class _Counting(ScatterAddInPlace):
    """The pass, counting the graph's tensors of zeros and additions before and after it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before = self._count(graph)
        super().__call__(graph)
        self.after = self._count(graph)
        graph.lint()

    @staticmethod
    def _count(graph) -> tuple[int, int]:
        targets = [node.target for node in graph.nodes]
        return targets.count(aten.full.default), targets.count(aten.add.Tensor)


def _summary_gradients(options: dict | None):
    """Gradients of a stream used whole (``sin``) and by the summaries' two gathers (the first 2 and
    last 4 rows of each sequence; one sequence shorter than 4 rows, so that its recent rows' mask is
    partly off)."""
    torch.manual_seed(0)
    offsets = torch.tensor([0, 12, 15, 215, 218, 308])
    proj = torch.nn.Linear(16, 16)
    x = torch.randn(int(offsets[-1]), 16, requires_grad=True)

    def loss(x):
        h = proj(x)
        summary = torch.cat([jagged_first(h, offsets, 2), jagged_last(h, offsets, 4)[0]], 1)
        return h.sin().sum() + summary.pow(3).sum()

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        (loss(x) if options is None else torch.compile(loss, options=options)(x)).backward()
    return x.grad, proj.weight.grad


def test_gathers_gradients_scatter_into_the_dense_gradient():
    """Under Inductor the two gathers' gradients (each a scatter into zeros, then summed, then added
    to the stream's dense gradient) become one chain of scatters that starts from the dense
    gradient: no tensor of zeros left, both additions gone. The gradients are the compiled graph's
    without the pass, bit for bit (no gathered row repeats), and the eager ones to rounding."""
    counting = _Counting()
    got = _summary_gradients({"post_grad_custom_pre_pass": counting})
    plain = _summary_gradients({})
    eager = _summary_gradients(None)
    (zeros, adds), (zeros_after, adds_after) = counting.before, counting.after
    assert zeros == 1  # one tensor of zeros that both scatters start from (Inductor shares it)
    assert (zeros_after, adds_after) == (0, adds - 2)
    for a, b, c in zip(got, plain, eager):
        assert torch.equal(a, b)
        assert (a - c).abs().max() <= 1e-5 * c.abs().max()


def _graph(dense_use: str, accumulate: bool = True, dtype=torch.float32):
    """``add(dense, index_put(zeros, [idx], values, accumulate))`` traced with fake tensors, as a
    post-grad graph holds it; ``dense_use``: "once" (a product used by the sum only), "twice" (also
    returned), or "input" (a graph input)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(src, idx, values):
        dense = src if dense_use == "input" else src * 2
        zeros = aten.full.default([8, 4], 0, dtype=dtype)
        out = aten.add.Tensor(dense, aten.index_put.default(zeros, [idx], values.to(dtype), accumulate))
        return (out, dense) if dense_use == "twice" else (out,)

    args = (torch.randn(8, 4), torch.tensor([1, 5, 6]), torch.randn(3, 4))
    return make_fx(f, tracing_mode="fake")(*args), args


@pytest.mark.parametrize(
    "dense_use, accumulate, dtype, rewritten",
    [
        ("once", True, torch.float32, True),
        ("twice", True, torch.float32, False),  # Inductor would copy it to scatter into
        ("input", True, torch.float32, False),  # a graph input: copied too
        ("once", False, torch.float32, False),  # a plain index_put overwrites, it does not add
        ("once", True, torch.float64, False),  # the sum promotes: another dtype than dense's
    ],
)
def test_the_rewrite_keeps_its_conditions(dense_use, accumulate, dtype, rewritten):
    """Only an accumulating scatter from zeros, added to a tensor of the sum's shape and dtype that
    nothing else uses, is rewritten; the graph computes the same either way."""
    module, args = _graph(dense_use, accumulate, dtype)
    want = module(*args)
    counting = _Counting()
    counting(module.graph)
    module.recompile()
    assert counting.after == ((0, 0) if rewritten else counting.before)
    for a, b in zip(module(*args), want):
        assert torch.equal(a, b)


def _pre_norm_blocks(options: dict | None):
    """Two pre-norm residual blocks without biases, ``x + W2 gelu(W1 LN(x))`` (gem's layers with
    ``model.row_bias=false``): the gradients of the input and of the blocks' last projections, and
    the code Inductor wrote (None: eager)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    blocks = [
        torch.nn.ModuleList(
            [torch.nn.LayerNorm(16), torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)]
        )
        for _ in range(2)
    ]
    x = torch.randn(40, 16, requires_grad=True)

    def loss(x):
        for norm, up, down in blocks:
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return x.square().sum()

    torch._dynamo.reset()
    code = []
    with inductor_config.patch(fx_graph_cache=False):
        if options is None:
            loss(x).backward()
        else:
            _, code = run_and_get_code(lambda: torch.compile(loss, options=options)(x).backward())
    return [x.grad, *(block[2].weight.grad for block in blocks)], "\n".join(code)


def test_a_residual_add_leaves_addmm():
    """Inductor fuses each block's residual add into ``addmm`` (which copies the residual into its
    output first); with :class:`AddAfterMatmul` no ``addmm`` is left, the products are plain
    ``mm``, and the gradients are the eager ones to rounding."""
    got, code = _pre_norm_blocks({"post_grad_custom_post_pass": AddAfterMatmul()})
    plain, plain_code = _pre_norm_blocks({})
    eager, _ = _pre_norm_blocks(None)
    assert "addmm" in plain_code  # the pattern the pass undoes is still Inductor's
    assert "addmm" not in code and "extern_kernels.mm(" in code
    for a, b in zip(got, eager):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize(
    "addend, beta, rewritten",
    [
        ("full", 1, True),
        ("bias", 1, False),  # a bias row stays on cuBLAS's epilogue
        ("expanded", 1, False),  # a bias broadcast to the output's shape (stride 0): the same
        ("full", 2, False),  # a scaled addend
    ],
)
def test_the_addmm_rewrite_keeps_its_conditions(addend, beta, rewritten):
    """Only ``addmm`` of a full-size addend with alpha = beta = 1 becomes ``mm`` and ``add``; the
    graph computes the same either way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(inp, a, b):
        if addend == "expanded":
            inp = inp.expand(6, 5)
        return aten.addmm.default(inp, a, b, beta=beta)

    args = (torch.randn(5 if addend != "full" else (6, 5)), torch.randn(6, 3), torch.randn(3, 5))
    module = make_fx(f, tracing_mode="fake")(*args)
    want = module(*args)
    AddAfterMatmul()(module.graph)
    module.graph.lint()
    module.recompile()
    targets = [node.target for node in module.graph.nodes]
    assert (aten.addmm.default not in targets) == rewritten
    assert (aten.mm.default in targets) == rewritten
    assert torch.allclose(module(*args), want, rtol=1e-6, atol=1e-6)


def test_the_option_hands_the_pass_to_each_compile(monkeypatch):
    """experimental.parallelism.scatter_in_place=true (with parallelism.compile) adds its pass to
    the options of the dense arch's compiles, beside the ``parallelism.inductor`` ones, and
    experimental.parallelism.residual_addmm=false adds its own; otherwise they stay as given."""
    from torch import nn

    import gem

    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda module, **kwargs: calls.append(kwargs))
    for on in (True, False):
        calls.clear()
        cfg = gem.compose(
            [
                "debug=tiny",
                "model=gem_tiny",
                "parallelism.compile=true",
                f"experimental.parallelism.scatter_in_place={str(on).lower()}",
                f"experimental.parallelism.residual_addmm={str(not on).lower()}",
                "+parallelism.inductor.combo_kernels=true",
            ]
        )
        gem.build_model(gem.build_data(cfg))
        assert calls and all(call["options"]["combo_kernels"] for call in calls)
        assert all(
            isinstance(call["options"].get("post_grad_custom_pre_pass"), ScatterAddInPlace) == on for call in calls
        )
        assert all(
            isinstance(call["options"].get("post_grad_custom_post_pass"), AddAfterMatmul) == on for call in calls
        )
