import pytest
import torch

from gem.data.format.dataset import split_files
from gem.data.pipeline.loader import build_loader
from gem.sparse.arch import SparseArch


def _batch(tiny_dataset, tiny_schema, n=32):
    return next(iter(build_loader(split_files(tiny_dataset, "train"), tiny_schema, n, options={"balance": False})))


def _pair(tiny_schema, dims=None):
    torch.manual_seed(0)
    a = SparseArch.from_config(tiny_schema, 8, dims=dims, backend="torchrec")
    b = SparseArch.from_config(tiny_schema, 8, dims=dims, backend="native")
    assert list(a.state_dict()) == list(b.state_dict()), "native mirrors TorchRec's parameter names"
    b.load_state_dict(a.state_dict())
    return a, b


def test_backends_agree_forward_and_backward(tiny_dataset, tiny_schema):
    a, b = _pair(tiny_schema, dims={"user_id": 6})
    batch = _batch(tiny_dataset, tiny_schema)
    outs = [m(batch.sparse, batch.sequences, batch.max_seq_len) for m in (a, b)]
    assert outs[0].pooled.keys() == outs[1].pooled.keys() == set(tiny_schema.id_feature_names)
    for name in tiny_schema.id_feature_names:
        torch.testing.assert_close(outs[0].pooled[name], outs[1].pooled[name], rtol=0, atol=0)
    assert outs[0].pooled["user_id"].shape == (32, 6)
    seq_a, seq_b = outs[0].sequences["hist"], outs[1].sequences["hist"]
    assert seq_a.values.shape == (int(seq_a.offsets[-1]), 4 * 8) and a.sequence_dim("hist") == 32
    torch.testing.assert_close(seq_a.values, seq_b.values, rtol=0, atol=0)
    assert torch.equal(seq_a.offsets, seq_b.offsets) and seq_a.offsets.dtype == torch.int64
    assert seq_a.max_len == batch.max_seq_len["hist"]
    # Gradients of the same loss reach the same rows in both backends.
    g = torch.Generator().manual_seed(1)
    for out in outs:
        w = torch.randn(seq_a.values.shape[1], generator=g)
        g.manual_seed(1)
        loss = (out.sequences["hist"].values @ w).sin().sum() + sum((v**2).sum() for v in out.pooled.values())
        loss.backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.grad is not None and pa.grad.abs().sum() > 0, name
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-6)


def test_empty_histories_give_empty_values(tiny_schema):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    a, b = _pair(tiny_schema)
    sparse = KeyedJaggedTensor(
        keys=tiny_schema.id_feature_names,
        values=torch.tensor([1, 2, 3, 1, 1, 1, 1]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.int32),
    )
    seq = KeyedJaggedTensor(
        keys=tiny_schema.sequence_feature_names,
        values=torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(8, dtype=torch.int32),
    )
    for m in (a, b):
        out = m(sparse, seq, {"hist": 0})
        assert out.sequences["hist"].values.shape == (0, 32)
        assert out.sequences["hist"].offsets.tolist() == [0, 0, 0]
        assert not out.pooled["user_interests"][1].any(), "an empty bag pools to zeros"


def test_unknown_feature_in_dims_names_the_key(tiny_schema):
    with pytest.raises(ValueError, match="sparse.dims: unknown feature 'nope'"):
        SparseArch.from_config(tiny_schema, 8, dims={"nope": 4})
    with pytest.raises(ValueError, match="sparse.dims: every sequence feature .* needs the same width"):
        SparseArch.from_config(tiny_schema, 8, dims={"hist_action": 4})
    with pytest.raises(ValueError, match="sparse.backend"):
        SparseArch.from_config(tiny_schema, 8, backend="fbgemm")


def test_shared_table_serves_id_and_sequence_features(tiny_dataset, tiny_schema):
    """The candidate ad and the history items look up one item table in both backends."""
    import copy

    from gem.data.pipeline.schema import FeatureSchema
    from tests.conftest import TINY_SCHEMA

    cfg = copy.deepcopy(TINY_SCHEMA)
    cfg["id_features"][1]["table"] = "item"  # ad_id
    cfg["sequence_groups"][0]["features"][0]["table"] = "item"  # hist_item
    schema = FeatureSchema.from_config(cfg)
    torch.manual_seed(0)
    a = SparseArch.from_config(schema, 8, backend="torchrec")
    b = SparseArch.from_config(schema, 8, backend="native")
    b.load_state_dict(a.state_dict())
    names = [t.name for t in a.tables]
    assert "t_item" in names and "t_ad_id" not in names and "t_hist_item" not in names
    assert "ec.embeddings.t_item.weight" in a.state_dict()
    batch = _batch(tiny_dataset, tiny_schema)
    outs = [m(batch.sparse, batch.sequences, batch.max_seq_len) for m in (a, b)]
    for name in schema.id_feature_names:
        torch.testing.assert_close(outs[0].pooled[name], outs[1].pooled[name])
    torch.testing.assert_close(outs[0].sequences["hist"].values, outs[1].sequences["hist"].values)
    item = a.table_weight("t_item")
    ad_ids = batch.sparse["ad_id"].values()
    torch.testing.assert_close(outs[0].pooled["ad_id"], item[ad_ids].detach())
    for out, model in zip(outs, (a, b)):
        out.pooled["ad_id"].sum().backward(retain_graph=True)
        grad = model.table_weight("t_item").grad
        assert torch.equal(grad.abs().sum(1) > 0, torch.bincount(ad_ids, minlength=80) > 0)

    bad = copy.deepcopy(cfg)
    bad["id_features"][1]["cardinality"] = 81
    with pytest.raises(ValueError, match="share table 'item' but have cardinalities"):
        FeatureSchema.from_config(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build of fbgemm-gpu")
def test_sharding_onto_cuda_without_fbgemm_cuda_kernels_says_what_to_install(tiny_schema):
    from gem.distributed.sharding import shard_sparse_arch

    arch = SparseArch.from_config(tiny_schema, 8, backend="torchrec", device="meta")
    with pytest.raises(ValueError, match=r"installed fbgemm-gpu has none \(fbgemm-gpu-cpu .*\).*or set sparse=native"):
        shard_sparse_arch(arch, torch.device("cuda"), 0.1, 1e-8)
