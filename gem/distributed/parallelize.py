"""``parallelize_gem``: float8 projections (optional), activation checkpointing, then torch.compile,
then FSDP2 ``fully_shard`` per dense block, in that fixed order, on the 1-D (FSDP) or 2-D (HSDP)
mesh of ParallelDims.

Only ``model.dense_arch`` is touched: the embedding tables in ``model.sparse_arch`` belong to
TorchRec (gem/distributed/sharding.py) and never become FSDP parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def dense_blocks(dense_arch: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards (one all-gather each) and checkpointing recomputes.

    A dense arch may name them with ``fsdp_blocks()``; otherwise they are its direct children
    that own parameters, with ``ModuleDict`` / ``ModuleList`` containers opened (a container's own
    forward is never called, so it cannot carry FSDP's hooks).
    """
    if hasattr(dense_arch, "fsdp_blocks"):
        return list(dense_arch.fsdp_blocks())
    blocks = []
    for child in dense_arch.children():
        members = (
            child.values()
            if isinstance(child, nn.ModuleDict)
            else child
            if isinstance(child, nn.ModuleList)
            else [child]
        )
        blocks.extend(m for m in members if any(True for _ in m.parameters()))
    return blocks


def allow_autograd_cache_with_functions() -> None:
    """Let AOTAutograd's cache store and reuse graphs that hold a custom ``autograd.Function``.

    torch (2.11 and 2.13 at least) bypasses that cache for any graph holding one, unless
    ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` is on; PyTorch has
    checked that such graphs are pure in their inputs and keeps the flag off only until it has
    tested it more widely. gem's PFFN traces one under compile (:func:`gem.models.sequence.generate_weights`),
    so without it every start traces the joint graph and runs the partitioner again: on an H200 a
    warm gem_base start's compile backend took 13.8-18.2 s, and 2.4-4.5 s with it (docs/e2e.md). The variable
    ``TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0`` still turns it off."""
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


def float8_projections(dense_arch: nn.Module, min_features: int) -> list[str]:
    """Swap the dense arch's large projections for torchao's ``Float8Linear`` (dynamic tensor-wise
    scales, e4m3 forward, e5m2 gradients) and return their names.

    A ``nn.Linear`` qualifies when both its widths are at least ``min_features`` and multiples of
    16 (the FP8 GEMM's alignment); the task heads never do, being the layers most sensitive to
    precision (and narrow). Token-level projections (Q/K/V, outputs, the pooling K/V) are the
    GEMMs that dominate a step; everything else keeps the autocast dtype. Their token count changes
    every batch, and it is the inner dimension of the weight-gradient GEMM, so the scaled matmul
    pads it to a multiple of 16 (``pad_inner_dim``).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and not name.startswith("heads")
            and min(module.in_features, module.out_features) >= min_features
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )
        if ok:
            chosen.append(name)
        return ok

    convert_to_float8_training(dense_arch, module_filter_fn=take, config=Float8LinearConfig(pad_inner_dim=True))
    return chosen


def parallelize_gem(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    compile_scope: str = "blocks",
    compile_options: dict | None = None,
    reshard_after_forward: bool = True,
    float8_min_features: int | None = None,
    scatter_in_place: bool = True,
    residual_addmm: bool = True,
) -> nn.Module:
    """Parallelize ``model.dense_arch`` in place and return ``model``.

    Args:
        model: a GEMModel (``sparse_arch`` + ``dense_arch``), dense weights already initialized
            (the same on every rank: ``fully_shard`` keeps each rank's slice of them).
        mesh: ``ParallelDims.build_mesh(...)``: 1-D ``("dp_shard",)`` is FSDP, 2-D
            ``("dp_replicate", "dp_shard")`` is HSDP. None: no sharding (one process), but
            checkpointing and compile still apply.
        param_dtype / reduce_dtype: FSDP2's MixedPrecisionPolicy: compute in ``param_dtype``
            (unsharded parameters are cast after the all-gather), reduce gradients in
            ``reduce_dtype``; the sharded parameters and the optimizer stay float32.
        activation_checkpointing: recompute each block's activations in backward.
        compile: ``torch.compile`` the dense arch, as ``compile_scope`` says. This also lets
            AOTAutograd's on-disk cache keep graphs that hold a custom ``autograd.Function``
            (:func:`allow_autograd_cache_with_functions`), as gem's dense archs do.
        compile_scope: ``"blocks"``, one graph per block (regional compilation: what FSDP2 and
            activation checkpointing wrap), or ``"dense_arch"``, one graph for the whole dense
            arch, which lets Inductor fuse across the blocks' boundaries and launches the step from
            one wrapper (unsharded dense arch only: ``mesh`` None, no activation checkpointing).
        compile_options: Inductor options for those compiles (``torch.compile``'s ``options``,
            ``parallelism.inductor``), None for its defaults.
        reshard_after_forward: free each block's gathered parameters after its forward and gather
            them again in backward (least memory); False keeps them gathered until the block's
            backward (one all-gather per block per step instead of two; ZeRO-2-like memory).
        float8_min_features: None, or train the projections at least this wide in float8
            (:func:`float8_projections`; needs torchao, and an SM89+ GPU to be faster).
        scatter_in_place: with ``compile``, Inductor scatters a row gather's gradient into the
            dense gradient it is added to instead of into a gradient of zeros
            (:class:`gem.distributed.inductor_passes.ScatterAddInPlace`): less memory traffic, the
            same sums but where gathered rows overlap, which it adds in another order.
        residual_addmm: with ``compile``, let Inductor add a full-size tensor to a product inside
            cuBLAS (``addmm``, after copying the tensor into the output), as it does by default;
            False adds it after the GEMM, in the kernel that reads the sum
            (:class:`gem.distributed.inductor_passes.AddAfterMatmul`).
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dense = model.dense_arch
    if compile_scope not in ("blocks", "dense_arch"):
        raise ValueError(f"compile_scope={compile_scope!r} must be 'blocks' or 'dense_arch'")
    whole = compile and compile_scope == "dense_arch"
    if whole and (mesh is not None or activation_checkpointing):
        raise ValueError(
            "compile_scope='dense_arch' compiles the dense arch as one graph, but FSDP2 (a mesh) and "
            "activation checkpointing wrap each block: use compile_scope='blocks' with them"
        )
    if float8_min_features is not None:
        float8_projections(dense, float8_min_features)
    if compile:
        allow_autograd_cache_with_functions()
        if scatter_in_place:
            from gem.distributed.inductor_passes import ScatterAddInPlace

            compile_options = (compile_options or {}) | {"post_grad_custom_pre_pass": ScatterAddInPlace()}
        if not residual_addmm:
            from gem.distributed.inductor_passes import AddAfterMatmul

            compile_options = (compile_options or {}) | {"post_grad_custom_post_pass": AddAfterMatmul()}
    blocks = dense_blocks(dense)
    for block in blocks:
        if activation_checkpointing:
            checkpoint(block)
        if compile and not whole:
            block.compile(options=compile_options)
    if whole:
        dense.compile(options=compile_options)
    if mesh is None:
        return model
    # Only the root casts its floating-point inputs to param_dtype; inside, each block's inputs are
    # what the model made them, so the rotary tables stay float32 as the kernels require
    # (FSDP2 would cast every floating tensor a block receives, the tables included)
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard_after_forward)
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(dense, mesh=mesh, mp_policy=root_policy)  # the root: parameters outside the blocks, if any
    return model
