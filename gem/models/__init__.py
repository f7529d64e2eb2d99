"""Models: ``GEMModel`` (a SparseArch's embeddings into a dense arch) and the dense archs the
``model`` config group names: ``GEMDenseArch`` (InterFormer or Kunlun blocks over jagged
event streams, multi-task / multi-domain heads), ``GenerativeSeqArch`` (next-event training) and
``DLRM``; plus the blocks for custom archs. Imported on first use (docs/models.md)."""

from importlib import import_module

_EXPORTS = {
    "GEMModel": "gem.models.gem",
    "Capabilities": "gem.models.capabilities",
    "GEMDenseArch": "gem.models.gem_arch",
    "GenerativeSeqArch": "gem.models.generative",
    "DLRM": "gem.models.dlrm",
    "InterFormerLayer": "gem.models.interformer",
    "KunlunLayer": "gem.models.kunlun",
    "MultiTaskHeads": "gem.models.heads",
    "MultiDomainHeads": "gem.models.heads",
    "JaggedSelfAttention": "gem.models.sequence",
    "PersonalizedFFN": "gem.models.sequence",
    "PoolingByAttention": "gem.models.sequence",
    "WukongLayer": "gem.models.interaction",
    "DCNv2": "gem.models.interaction",
    "MLP": "gem.models.layers",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gem.models' has no attribute {name!r}")
