"""A DLRM-style baseline dense architecture (validates the training loop; InterFormer and
Kunlun plug into the same place).

Data flow::

    dense [B, num_dense] --bottom MLP--> x0 [B, D] ----------------------------+
    pooled id embeddings, each [B, D_f] --(project to D)--> [B, D] each -------+-- stack [B, F, D]
    each sequence group: jagged mean of [T, D_g] --linear--> [B, D] -----------+        |
    domain embedding [B, D] ----------------------------------------------------+   pairwise dots
                                                                                      |
                                    concat(x0, dots) --top MLP--> [B, H] --heads--> logits [B, K]
"""

from __future__ import annotations

import torch
from torch import nn

from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import Capabilities
from gem.models.heads import MultiTaskHeads
from gem.models.layers import MLP, dot_interaction
from gem.sparse.arch import SparseOutput
from kernels.jagged import jagged_mean


class DLRM(nn.Module):
    """Args:
    schema: the feature schema.
    feature_dims: embedding width of each id feature and of each sequence group (from the SparseArch).
    dim: common width ``D`` of the interaction.
    bottom_mlp / top_mlp / tower_mlp: hidden widths.
    """

    capabilities = Capabilities(head_representation=True)  # the top MLP's output feeds the heads

    def __init__(
        self,
        schema: FeatureSchema,
        feature_dims: dict[str, int],
        dim: int = 16,
        bottom_mlp: tuple[int, ...] = (64,),
        top_mlp: tuple[int, ...] = (128, 64),
        tower_mlp: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.schema = schema
        self.bottom = MLP(schema.num_dense, tuple(bottom_mlp) + (dim,))
        self.project = nn.ModuleDict(
            {name: (nn.Identity() if d == dim else nn.Linear(d, dim, bias=False)) for name, d in feature_dims.items()}
        )
        self.domain_embedding = nn.Embedding(schema.num_domains, dim)
        num_vectors = 2 + len(feature_dims)  # bottom output, domain, features
        self.top = MLP(dim + num_vectors * (num_vectors - 1) // 2, tuple(top_mlp))
        self.heads = MultiTaskHeads(self.top.out_dim, schema.num_tasks, schema.num_domains, tuple(tower_mlp))

    def init_weights(self) -> None:
        self.bottom.init_weights()
        self.top.init_weights()
        self.heads.init_weights()
        for p in self.project.values():
            if isinstance(p, nn.Linear):
                nn.init.xavier_uniform_(p.weight)
        nn.init.normal_(self.domain_embedding.weight, std=0.05)

    def forward(self, sparse: SparseOutput, dense: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        x0 = self.bottom(dense)
        vectors = [x0, self.domain_embedding(domain)]
        for name in self.schema.id_feature_names:
            vectors.append(self.project[name](sparse.pooled[name]))
        for group in self.schema.sequence_groups:
            seq = sparse.sequences[group.name]
            vectors.append(self.project[group.name](jagged_mean(seq.values, seq.offsets)))
        interactions = dot_interaction(torch.stack(vectors, dim=1))
        return self.heads(self.top(torch.cat([x0, interactions], dim=1)), domain)
