"""Generative next-event training over jagged histories: the GEM blocks' sequence arches in their
causal mode, trained the way sequential-recommendation foundation models are.

One pass over each history predicts the next event at every position (causal jagged attention,
nothing padded), scored against the item table that also embeds the inputs, with a sampled
softmax over in-batch and uniformly sampled negatives (logQ-corrected). Data flow::

    history events [T, D_e] (item | per-event attributes) ─ linear ─► S [T, W]
    user tokens (id features that do not describe the candidate) ─ gate(W flat) ─► X_sum [B, N, d]
    num_layers x   S = PFFN(S | X_sum)          (GDPA form; Kunlun's CompSkip layers skip it)
                   S = causal MHA_rope(S)        (Kunlun: within a sliding window)
                   S = FFN(S)                    (shared by every row; with ffn > 0)
    LN ─ linear ─► H [T, D_item]: the user after each event

    training  H[t] scores item[t+1] against the negatives (loss in ``forward``, see below)
    ranking   H at a history's last event scores each row's candidate: logits [B, 1]
    pretraining (objective=masked_item): attention not causal, masked events' rows replaced,
              H[t] of a masked event scores its own item[t]

Only the sequence side of the blocks runs: their non-sequence interactions (InterFormer's
interaction arch, Kunlun's Wukong and seed pooling) read summaries of the whole history, which
would let a position see its future.

``forward`` returns the mean next-event loss ``[1, 1]`` in training mode (``returns_loss = True``
tells the trainer) and ranking logits ``[B, 1]`` in eval mode, so evaluation rows (a history and
one candidate each, gem.data.sources.seqrec) run through the usual ranking metrics. With
``objective="ranking"`` it returns ranking logits in training too, for labelled rows.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import Capabilities
from gem.models.interformer import NonSequenceSummary
from gem.models.layers import init_module_tree
from gem.models.sequence import JaggedSelfAttention, PersonalizedFFN, linear_flops, rotary_tables
from gem.sparse.arch import JaggedEmbeddings, SparseOutput
from kernels.jagged import jagged_positions, lengths_to_offsets, offsets_to_lengths, segment_ids

BLOCKS = ("interformer", "kunlun")
SIMILARITIES = ("cosine", "dot")
OBJECTIVES = ("next_event", "masked_item", "ranking")

logger = logging.getLogger("gem")


class FeedForward(nn.Module):
    """Pre-norm position-wise FFN, residual: ``x + drop(W_2 gelu(W_1 LN(x)))``, shared by every
    row (the personalized FFN generates its weights per user instead)."""

    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))

    def flops(self, lengths: torch.Tensor) -> int:
        rows = int(lengths.sum())
        return linear_flops(rows, self.up.in_features, self.up.out_features) + linear_flops(
            rows, self.down.in_features, self.down.out_features
        )


class CausalSequenceLayer(nn.Module):
    """One block's sequence arch, causal: ``S = FFN(MHA_rope(PFFN(S | X_sum)))`` (no PFFN on a
    CompSkip layer; the shared FFN only with ``ffn_hidden``). ``causal=False`` lets every row see
    the whole history (masked-item pretraining); the weights are the same either way."""

    def __init__(
        self,
        width: int,
        num_heads: int,
        summary_dim: int,
        num_summary: int,
        pffn_kv: int,
        pffn_activation: str,
        window: int | None,
        use_pffn: bool,
        backend: str | None,
        ffn_hidden: int = 0,
        residual_dropout: float = 0.0,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.pffn = (
            PersonalizedFFN(width, num_heads, summary_dim, num_summary, pffn_kv, pffn_activation, backend)
            if use_pffn
            else None
        )
        self.attention = JaggedSelfAttention(width, num_heads, window, backend, causal=causal, dropout=residual_dropout)
        self.ffn = FeedForward(width, ffn_hidden, residual_dropout) if ffn_hidden else None

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        summary: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        if self.pffn is not None:
            x = self.pffn(x, offsets, max_len, summary)
        x = self.attention(x, offsets, max_len, rope)
        return x if self.ffn is None else self.ffn(x)

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        total = self.attention.flops(lengths, max_len, padded)
        total += self.ffn.flops(lengths) if self.ffn is not None else 0
        return total + (self.pffn.flops(lengths, max_len, padded) if self.pffn is not None else 0)


class GenerativeSeqArch(nn.Module):
    """Args:
    schema / feature_dims: the feature schema and the SparseArch's widths (passed by the trainer).
    block: ``"interformer"`` (a PFFN in every layer, full causal attention) or ``"kunlun"``
        (CompSkip on odd layers with ``compskip``, attention within ``window``).
    dim / num_summary: width and count of the user summary tokens that generate the PFFN.
    num_layers / num_heads / head_dim / window / pffn_kv / pffn_activation: the sequence arch.
    sequence / negatives: the event stream and the group of sampled negatives (gem.data.sources.seqrec's
        ``hist`` and ``neg``); the stream's first feature is the item, whose table scores.
    candidate_features: the id features that describe a ranking row's candidate (``item_id``,
        the one scored, first); every other id feature is a user token.
    item_attributes: score an item as its id embedding plus a linear map of the sum of its
        attribute embeddings (the events' and negatives' attribute features, the ranking row's
        ``candidate_features[1]`` bag), so that items seen rarely as targets share what their
        attributes learned. Needs the bag to hold as many attributes as an event carries
        (``data.seqrec.max_attrs == data.seqrec.event_attrs``). ``None``: when the data has the
        attribute bag (a seqrec folder with ``<name>_item2attributes.json``), else off, and
        ``attribute_loss`` with it, said in one info line; ``True`` on data without it fails.
    similarity / temperature: ``cosine`` (scaled by ``1 / temperature``) or ``dot``.
    item_bias: the last column of a scored item's row (its id row, plus ``attr_proj`` of its
        attributes with ``item_attributes``) is the item's bias logit, added to the similarity of
        the query with the other columns: a prior per item that a cosine score, bounded by
        ``1 / temperature``, cannot carry. The queries are one column narrower.
    in_batch_negatives: at most this many of the batch's next events are each position's
        in-batch negatives (all of them when there are fewer).
    logq_correction: subtract each candidate's log expected count from its logit (an item drawn
        often as an in-batch negative is not pushed down for being popular); False for ablations.
    pffn: the personalized FFN in the layers (False: attention only, for ablations).
    ffn: hidden width of a shared position-wise GELU FFN after each layer's attention, as a
        multiple of the row width (0: none).
    dropout: on the event embeddings and on ``H``.
    residual_dropout: on the output of each attention and shared FFN before its residual add.
    label_smoothing: ``eps``: the next-event loss is ``(1 - eps)`` times its cross-entropy plus
        ``eps`` times the cross-entropy against a uniform target over the position's candidates.
    attribute_loss: weight of an auxiliary loss (0: none): each position also predicts the next
        event's attributes, a softmax over the attribute vocabulary (its own output layer) averaged
        over the attributes the event carries. Needs ``item_attributes`` (off with it when
        ``item_attributes=None`` finds no attributes).
    cooccurrence / cooccurrence_window: weight ``gamma`` of an item-based collaborative-filtering
        prior in the ranking score (0: none): ``gamma * log(1 + sum_j S[j, c])`` is added to the
        score of candidate ``c``, over the last ``cooccurrence_window`` events ``j`` of the history,
        with ``S`` the items' cosine of co-occurrence over the training split's users
        (gem.data.sources.seqrec.item_cooccurrence, handed over by :meth:`set_cooccurrence`). It is
        fixed, not trained, and the next-event and masked-item losses do not use it.
    attention_backend: ``kernels.jagged_attention`` backend.
    objective: ``next_event`` (the sampled softmax above); ``masked_item``, pretraining in the
        manner of S3-Rec's masked item prediction: attention over the whole history (not
        causal), ``mask_prob`` of the events replaced by a learned mask row, and each masked
        position scores its own item with the same sampled softmax (and, with
        ``attribute_loss``, predicts its own attributes), for a ``next_event`` run to start from
        (``checkpoint.init_from``); or ``ranking``: the ranking logits in training too, for
        labelled (history, candidate) rows and the trainer's task loss, e.g. to fine-tune a
        next-event model on a ranking task.
    mask_prob: with ``masked_item``, the chance that an event is masked.
    """

    def __init__(
        self,
        schema: FeatureSchema,
        feature_dims: dict[str, int],
        block: str = "interformer",
        dim: int = 32,
        num_layers: int = 2,
        num_heads: int = 2,
        head_dim: int = 32,
        window: int | None = None,
        num_summary: int = 2,
        pffn_kv: int = 8,
        pffn_activation: str = "silu",
        compskip: bool = True,
        sequence: str = "hist",
        negatives: str | None = "neg",
        candidate_features: tuple[str, ...] = ("item_id", "item_attr"),
        item_attributes: bool | None = False,
        similarity: str = "cosine",
        temperature: float = 0.05,
        item_bias: bool = False,
        in_batch_negatives: int = 4096,
        logq_correction: bool = True,
        pffn: bool = True,
        ffn: int = 0,
        dropout: float = 0.0,
        residual_dropout: float = 0.0,
        label_smoothing: float = 0.0,
        attribute_loss: float = 0.0,
        cooccurrence: float = 0.0,
        cooccurrence_window: int = 10,
        attention_backend: str | None = None,
        objective: str = "next_event",
        mask_prob: float = 0.2,
    ) -> None:
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"model.objective={objective!r} must be one of {list(OBJECTIVES)}")
        if objective == "masked_item" and not 0 < mask_prob < 1:
            raise ValueError(f"model.mask_prob={mask_prob!r} must be in (0, 1) for model.objective=masked_item")
        # next_event / masked_item: forward returns the training loss in training mode (the module
        # docstring); ranking: ranking logits always, for the trainer's task loss on labelled rows
        self.returns_loss = objective in ("next_event", "masked_item")
        self.masked = objective == "masked_item"
        self.mask_prob = mask_prob
        if block not in BLOCKS:
            raise ValueError(f"model.block={block!r} must be one of {list(BLOCKS)}")
        if similarity not in SIMILARITIES:
            raise ValueError(f"model.similarity={similarity!r} must be one of {list(SIMILARITIES)}")
        groups = {g.name: g for g in schema.sequence_groups}
        if sequence not in groups:
            raise ValueError(f"model.sequence={sequence!r}: the schema's sequence groups are {list(groups)}")
        if negatives is not None and negatives not in groups:
            raise ValueError(
                f"model.negatives={negatives!r}: the schema's sequence groups are {list(groups)}; "
                "set model.negatives=null to train on in-batch negatives only"
            )
        self.item_feature = groups[sequence].feature_names[0]
        self.candidate_attrs = candidate_features[1] if len(candidate_features) > 1 else None
        self.negative_feature = groups[negatives].feature_names[0] if negatives else None
        self.candidate = candidate_features[0]
        tables = {f.name: f.table_name for f in schema.id_features}
        tables |= {f.name: f.table_name for g in schema.sequence_groups for f in g.features}
        scored = [f for f in (self.candidate, self.negative_feature) if f is not None]
        if any(tables.get(f) != tables[self.item_feature] for f in scored):
            raise ValueError(
                f"model: {scored} must share the table of {self.item_feature!r} "
                f"({tables[self.item_feature]!r}): the item table scores the next event"
            )
        self.user_features = [f for f in schema.id_feature_names if f not in candidate_features]
        if not self.user_features:
            raise ValueError(
                f"model.candidate_features={list(candidate_features)} leaves no user id feature "
                "to generate the personalized FFN from"
            )
        self.sequence, self.negatives = sequence, negatives
        if item_attributes is None:  # use the attributes when the data has them (docs/seqrec.md)
            bag = candidate_features[1] if len(candidate_features) > 1 else None
            item_attributes = bag in tables
            if not item_attributes:
                why = (
                    f"the data has no {bag!r} feature (no <name>_item2attributes.json)"
                    if bag
                    else "model.candidate_features names no attribute bag"
                )
                dropped = f"; model.attribute_loss={attribute_loss!r} is off with them" if attribute_loss > 0 else ""
                logger.info("model.item_attributes=null: %s: items are scored by their id rows alone%s", why, dropped)
                attribute_loss = 0.0 if attribute_loss > 0 else attribute_loss
        self.attr_slots: dict[str, list[str]] = {}  # group -> its attribute features, when items are scored with them
        if item_attributes:
            self.attr_slots = _attribute_slots(schema, tables, candidate_features, sequence, negatives)
        slots = [f for names in self.attr_slots.values() for f in names]
        if cooccurrence < 0 or cooccurrence_window < 1:
            raise ValueError(
                f"model.cooccurrence={cooccurrence!r} must be >= 0 (0: no prior) and "
                f"model.cooccurrence_window={cooccurrence_window!r} >= 1"
            )
        self.cooccurrence, self.cooccurrence_window = cooccurrence, cooccurrence_window
        # ranking rows' candidate ids, for the co-occurrence prior (GEMModel hands over pooled ones too)
        prior = self.candidate if cooccurrence else None
        self.sequence_ids = tuple(f for f in (self.item_feature, self.negative_feature, *slots, prior) if f is not None)
        self.capabilities = Capabilities(
            returns_loss=self.returns_loss,
            sequence_ids=self.sequence_ids,
            item_cooccurrence=cooccurrence > 0,
            counts_flops=True,
        )
        self.num_items = schema.cardinality(self.item_feature)
        self.item_dim = feature_dims[self.candidate]
        if item_bias and self.item_dim < 2:
            raise ValueError(
                f"model.item_bias=true uses the last of the item table's columns as a bias: "
                f"its width {self.item_dim} leaves none to score with; set sparse.embedding_dim >= 2"
            )
        self.item_bias = item_bias
        query_dim = self.item_dim - 1 if item_bias else self.item_dim
        self.block, self.similarity, self.temperature = block, similarity, temperature
        self.in_batch_negatives, self.num_heads, self.head_dim = in_batch_negatives, num_heads, head_dim
        self.logq_correction = logq_correction
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"model.label_smoothing={label_smoothing!r} must be in [0, 1)")
        self.label_smoothing = label_smoothing
        if ffn < 0 or not 0 <= residual_dropout < 1:
            raise ValueError(
                f"model.ffn={ffn!r} must be >= 0 (0: no shared FFN) and "
                f"model.residual_dropout={residual_dropout!r} in [0, 1)"
            )
        width = num_heads * head_dim

        self.user_proj = nn.ModuleDict({f: nn.Linear(feature_dims[f], dim) for f in self.user_features})
        self.user_summary = NonSequenceSummary(len(self.user_features), num_summary, dim)
        self.event_proj = nn.Linear(feature_dims[sequence], width)
        self.layers = nn.ModuleList(
            CausalSequenceLayer(
                width,
                num_heads,
                dim,
                num_summary,
                pffn_kv,
                pffn_activation,
                window,
                pffn and not (block == "kunlun" and compskip and i % 2 == 1),
                attention_backend,
                ffn * width,
                residual_dropout,
                causal=not self.masked,
            )
            for i in range(num_layers)
        )
        self.mask_row = nn.Embedding(1, width) if self.masked else None  # a masked event's input row
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, query_dim)
        self.dropout = nn.Dropout(dropout)
        self.attr_proj = (
            nn.Linear(feature_dims[candidate_features[1]], self.item_dim, bias=False) if self.attr_slots else None
        )
        if attribute_loss < 0 or (attribute_loss and not self.attr_slots):
            raise ValueError(
                f"model.attribute_loss={attribute_loss!r} must be >= 0 and needs the events' attributes: "
                "set model.item_attributes=true (and data.seqrec.event_attrs >= 1), or model.attribute_loss=0"
            )
        self.attribute_loss = attribute_loss
        # S of the co-occurrence prior as sorted keys (i * num_items + j) and values; not in checkpoints:
        # the trainer computes it from the training split at every start (set_cooccurrence)
        self.register_buffer("cooc_keys", torch.zeros(0, dtype=torch.int64), persistent=False)
        self.register_buffer("cooc_values", torch.zeros(0), persistent=False)
        self.attr_head = (
            nn.Linear(query_dim, schema.cardinality(self.attr_slots[sequence][0])) if attribute_loss else None
        )

    def init_weights(self) -> None:
        """Initialize every parameter (after ``to_empty``); fails if a parameter has no rule."""
        init_module_tree(self)

    def encode(self, sparse: SparseOutput, masked: torch.Tensor | None = None) -> torch.Tensor:
        """``H [T, D_item]``: the representation after each event of the stream (with ``masked``
        ``[T]``, those events' input rows replaced by the mask row: neither their item nor their
        attributes are seen)."""
        s = sparse.sequences[self.sequence]
        users = torch.stack([self.user_proj[f](sparse.pooled[f]) for f in self.user_features], dim=1)  # [B, F, d]
        summary = self.user_summary(users)  # [B, N, d]
        x = self.event_proj(s.values)
        if masked is not None:
            x = torch.where(masked[:, None], self.mask_row.weight.to(x.dtype), x)
        x = self.dropout(x)
        rope = rotary_tables(s.offsets, x.shape[0], self.head_dim)
        for layer in self.layers:
            x = layer(x, s.offsets, s.max_len, summary, rope)
        return self.out(self.dropout(self.norm(x)))

    def score(self, queries: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """``[Q, C]`` scores of query rows against item embeddings (cosine / temperature, or dot;
        plus the items' bias column with ``item_bias``)."""
        items, bias = self._split_bias(items)
        if self.similarity == "cosine":
            scores = F.normalize(queries.float(), dim=-1) @ F.normalize(items.float(), dim=-1).T / self.temperature
        else:
            scores = queries.float() @ items.float().T
        return scores if bias is None else scores + bias[None, :]

    def forward(
        self,
        sparse: SparseOutput,
        dense: torch.Tensor,
        domain: torch.Tensor,
        ids: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.training and self.masked:
            return self.masked_item_loss(sparse, ids).view(1, 1)
        if self.training and self.returns_loss:
            return self.next_event_loss(self.encode(sparse), sparse, ids).view(1, 1)
        last = self.last_states(sparse)
        candidates = sparse.pooled[self.candidate]
        if self.attr_proj is not None:  # the bag of the candidate's attributes, summed by the SparseArch
            candidates = candidates + self.attr_proj(sparse.pooled[self.candidate_attrs])
        scores = self._rows(last, candidates)
        if self.cooccurrence:
            offsets = sparse.sequences[self.sequence].offsets
            prior = self.cooccurrence_prior(offsets, ids[self.item_feature], ids[self.candidate])
            scores = scores + self.cooccurrence * prior
        return scores.unsqueeze(1)

    def set_cooccurrence(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``S`` of the co-occurrence prior: sorted keys ``i * num_items + j`` and their values, as
        gem.data.sources.seqrec.item_cooccurrence gives them for this model's item table."""
        device = self.cooc_keys.device
        end = torch.tensor([torch.iinfo(torch.int64).max])  # past every key: a lookup always lands on an entry
        self.cooc_keys = torch.cat([keys.to(torch.int64), end]).to(device)
        self.cooc_values = torch.cat([values.to(torch.float32), torch.zeros(1)]).to(device)

    def cooccurrence_prior(self, offsets: torch.Tensor, items: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``[B]``: ``log(1 + sum_j S[j, candidates[b]])`` over the last ``cooccurrence_window`` of
        row ``b``'s history items ``j`` (``items``: the rows' histories, jagged by ``offsets``)."""
        if not self.cooc_keys.numel():
            raise RuntimeError(
                "model.cooccurrence: the training split's co-occurrence was never set "
                "(GenerativeSeqArch.set_cooccurrence); gem.train's build_model sets it from the data"
            )
        total = items.shape[0]
        row = segment_ids(offsets, total)
        recent = jagged_positions(offsets, total) >= offsets_to_lengths(offsets)[row] - self.cooccurrence_window
        row = row[recent]
        key = items[recent] * self.num_items + candidates[row]
        at = torch.searchsorted(self.cooc_keys, key)
        found = torch.where(self.cooc_keys[at] == key, self.cooc_values[at], 0.0)
        sums = torch.zeros(offsets.shape[0] - 1, device=items.device).index_add_(0, row, found)
        return torch.log1p(sums)

    def last_states(self, sparse: SparseOutput) -> torch.Tensor:
        """``[B, D_item]``: ``H`` after each row's last event (zeros for an empty history).

        Ranking rows come as runs of one user's history with one candidate each (1 + 99 rows per
        user in gem.data.sources.seqrec): each run of consecutive rows whose user tokens and history are
        the same is encoded once and its state shared, which gives the same numbers."""
        s = sparse.sequences[self.sequence]
        keep, inverse = _distinct_runs(s, [sparse.pooled[f] for f in self.user_features])
        if keep is not None:
            lengths = offsets_to_lengths(s.offsets)[keep]
            offsets = lengths_to_offsets(lengths)
            total = int(offsets[-1])
            rows = torch.repeat_interleave(s.offsets[:-1][keep], lengths, output_size=total)
            rows = rows + jagged_positions(offsets, total)
            sparse = SparseOutput(
                {f: sparse.pooled[f][keep] for f in self.user_features},
                {self.sequence: JaggedEmbeddings(s.values[rows], offsets, s.max_len)},
            )
            s = sparse.sequences[self.sequence]
        h = self.encode(sparse)
        lengths = offsets_to_lengths(s.offsets)
        last = h[(s.offsets[1:] - 1).clamp_min(0)] * (lengths > 0).unsqueeze(1)
        return last if keep is None else last[inverse]

    def next_event_loss(self, h: torch.Tensor, sparse: SparseOutput, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean over positions that have a next event of the sampled softmax loss of that event.

        Per position ``t`` with next item ``y``: ``-log softmax`` of ``score(H[t], e_y)`` against the
        negatives, every logit less ``log Q(item)``, the expected number of times the item is
        among the negatives: ``M count(item) / T`` for ``M`` in-batch negatives drawn from the
        ``T`` positions (``count``: how often it is a next event), plus ``U / N`` for ``U`` uniform
        ones over ``N`` items. A negative that is the position's own next item (an accidental hit)
        is left out. With ``label_smoothing`` the loss mixes in the uniform target over the
        candidates a position sees (its next item and its visible negatives).
        """
        s = sparse.sequences[self.sequence]
        total = h.shape[0]
        row = torch.arange(total, device=h.device)
        pos = jagged_positions(s.offsets, total)
        has_next = pos < offsets_to_lengths(s.offsets)[segment_ids(s.offsets, total)] - 1  # [T]
        nxt = (row + 1).clamp(max=max(total - 1, 0))
        loss = self._item_loss(h, sparse, ids, nxt, has_next, has_next)
        if self.attr_head is None:
            return loss
        return loss + self.attribute_loss * self.target_attribute_loss(h, ids, nxt, has_next)

    def masked_item_loss(self, sparse: SparseOutput, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        """Masked item prediction (``objective=masked_item``): each event is masked with
        ``mask_prob`` (at least one per batch), the whole history encoded, and each masked
        position's own item scored as :meth:`next_event_loss` scores the next one; every event's
        item is an in-batch negative. With ``attribute_loss``, masked positions also predict
        their own attributes (S3-Rec's masked attribute prediction)."""
        values = sparse.sequences[self.sequence].values
        total = values.shape[0]
        masked = torch.rand(total, device=values.device) < self.mask_prob
        if total:
            masked[torch.randint(0, total, (1,), device=values.device)] = True
        h = self.encode(sparse, masked)
        row = torch.arange(total, device=values.device)
        every = torch.ones_like(masked)
        loss = self._item_loss(h, sparse, ids, row, every, masked)
        if self.attr_head is None:
            return loss
        return loss + self.attribute_loss * self.target_attribute_loss(h, ids, row, masked)

    def _item_loss(
        self,
        h: torch.Tensor,
        sparse: SparseOutput,
        ids: dict[str, torch.Tensor],
        target_rows: torch.Tensor,
        target_ok: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The sampled softmax loss of :meth:`next_event_loss`, averaged over the positions where
        ``weight`` holds: position ``t`` targets the item of event ``target_rows[t]``; the
        in-batch negatives are drawn from the targets where ``target_ok`` holds."""
        s = sparse.sequences[self.sequence]
        total, device = h.shape[0], h.device
        target_emb = self.item_rows(s.values, ids, self.sequence)[target_rows]  # the target's item (the shared table)
        target_ids = ids[self.item_feature][target_rows]
        weight = weight.to(torch.float32)

        if total > self.in_batch_negatives:  # in-batch negatives: a random subset of the targets
            pool = torch.randint(0, total, (self.in_batch_negatives,), device=device)
        else:
            pool = torch.arange(total, device=device)
        cand_emb, cand_ids, cand_ok = target_emb[pool], target_ids[pool], target_ok[pool]
        num_drawn = pool.numel()
        uniform = 0
        if self.negatives is not None:
            neg = sparse.sequences[self.negatives]
            uniform = neg.values.shape[0]
            cand_emb = torch.cat([cand_emb, self.item_rows(neg.values, ids, self.negatives)])
            cand_ids = torch.cat([cand_ids, ids[self.negative_feature]])
            cand_ok = torch.cat([cand_ok, torch.ones(uniform, dtype=torch.bool, device=device)])

        counts = torch.zeros(self.num_items, device=device).index_add_(0, target_ids, target_ok.to(torch.float32))
        expected = counts * (num_drawn / max(total, 1)) + uniform / max(self.num_items - 1, 1)
        log_q = torch.log(expected.clamp_min(1e-12)) if self.logq_correction else torch.zeros_like(expected)
        positive = self._rows(h, target_emb) - log_q[target_ids]  # [T]
        logits = self.score(h, cand_emb) - log_q[cand_ids][None, :]  # [T, C]
        hidden = ~cand_ok[None, :] | (cand_ids[None, :] == target_ids[:, None])
        logits = logits.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(torch.cat([positive[:, None], logits], dim=1), dim=1)
        loss = lse - positive
        if self.label_smoothing:
            seen = (~hidden).sum(1) + 1  # candidates per position, its target included
            mean_logit = (positive + logits.masked_fill(hidden, 0.0).sum(1)) / seen
            loss = (1 - self.label_smoothing) * loss + self.label_smoothing * (lse - mean_logit)
        return (loss * weight).sum() / weight.sum().clamp_min(1.0)

    def target_attribute_loss(
        self, h: torch.Tensor, ids: dict[str, torch.Tensor], target_rows: torch.Tensor, use: torch.Tensor
    ) -> torch.Tensor:
        """Mean over positions ``t`` where ``use`` holds and whose target event ``target_rows[t]``
        (the next one; a masked position's own) has attributes, of ``-mean_a log softmax(W H[t])[a]``
        over that event's attributes ``a`` (id 0: none)."""
        targets = torch.stack([ids[f] for f in self.attr_slots[self.sequence]], dim=1)[target_rows]  # [T, A]
        present = (targets != 0) & use[:, None]
        log_p = F.log_softmax(self.attr_head(h).float(), dim=-1).gather(1, targets)  # [T, A]
        per_row = (log_p * present).sum(1) / present.sum(1).clamp_min(1)
        rows = present.any(1).to(torch.float32)
        return -(per_row * rows).sum() / rows.sum().clamp_min(1.0)

    def item_rows(self, values: torch.Tensor, ids: dict[str, torch.Tensor], group: str) -> torch.Tensor:
        """``[T, D_item]``: the item of each event of ``group`` as it is scored: its id embedding (the
        group's first columns), plus ``attr_proj`` of its attribute embeddings summed where an
        attribute is present (id 0 marks a missing one, which the candidate's bag leaves out)."""
        items = values[:, : self.item_dim]
        if self.attr_proj is None:
            return items
        attrs = values[:, self.item_dim :].unflatten(1, (len(self.attr_slots[group]), -1))  # [T, A, D_attr]
        present = torch.stack([ids[f] != 0 for f in self.attr_slots[group]], dim=1).unsqueeze(-1)
        return items + self.attr_proj((attrs * present).sum(1))

    def _rows(self, queries: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Row-wise scores ``[T]`` of ``queries[t]`` against ``items[t]``."""
        items, bias = self._split_bias(items)
        if self.similarity == "cosine":
            scores = (F.normalize(queries.float(), dim=-1) * F.normalize(items.float(), dim=-1)).sum(
                -1
            ) / self.temperature
        else:
            scores = (queries.float() * items.float()).sum(-1)
        return scores if bias is None else scores + bias

    def _split_bias(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Items' scored columns and, with ``item_bias``, their bias logits (the last column)."""
        if not self.item_bias:
            return items, None
        return items[:, :-1], items[:, -1].float()

    def flops(
        self,
        batch_size: int,
        lengths: dict[str, torch.Tensor],
        max_lens: dict[str, int] | None = None,
        padded: bool = False,
    ) -> dict[str, int]:
        """Analytic FLOPs of a training step's forward and backward (matmuls, true jagged lengths)."""
        n = lengths[self.sequence].detach().long().cpu()
        rows = int(n.sum())
        max_len = int(n.max()) if n.numel() else 0
        b = batch_size
        fwd = sum(linear_flops(b, m.in_features, m.out_features) for m in self.user_proj.values())
        fwd += self.user_summary.flops(b) + linear_flops(
            rows, self.event_proj.in_features, self.event_proj.out_features
        )
        fwd += sum(layer.flops(n, max_len, padded) for layer in self.layers)
        fwd += linear_flops(rows, self.out.in_features, self.out.out_features)
        uniform = int(lengths[self.negatives].sum()) if self.negatives is not None and self.negatives in lengths else 0
        num_negatives = min(rows, self.in_batch_negatives) + uniform
        if self.attr_proj is not None:  # the scored items' attributes: the events' and the uniform negatives'
            fwd += linear_flops(rows + uniform, self.attr_proj.in_features, self.attr_proj.out_features)
        fwd += 2 * rows * (num_negatives + 1) * self.item_dim  # the scores
        if self.attr_head is not None:
            fwd += linear_flops(rows, self.attr_head.in_features, self.attr_head.out_features)
        return {"forward": fwd, "backward": 2 * fwd}


def _attribute_slots(
    schema: FeatureSchema,
    tables: dict[str, str],
    candidate_features: tuple[str, ...],
    sequence: str,
    negatives: str | None,
) -> dict[str, list[str]]:
    """The attribute features of the event and negative groups for ``item_attributes``: every feature
    after the item, each in the table of the candidate's attribute bag ``candidate_features[1]``."""
    if len(candidate_features) < 2:
        raise ValueError(
            f"model.item_attributes=true needs the candidate's attribute bag as "
            f"model.candidate_features[1]; got {list(candidate_features)}"
        )
    if candidate_features[1] not in tables:
        raise ValueError(
            f"model.item_attributes=true scores items with their attributes, but the data has no "
            f"{candidate_features[1]!r} feature (a seqrec folder without <name>_item2attributes.json has "
            "none): set model.item_attributes=false (and model.attribute_loss=0)"
        )
    bag = candidate_features[1]
    slots = {}
    for group in (g for g in (sequence, negatives) if g is not None):
        names = schema.group(group).feature_names[1:]
        if not names or any(tables[f] != tables[bag] for f in names):
            raise ValueError(
                f"model.item_attributes=true: the features after the item in group {group!r} "
                f"({names}) must all be attributes in the table of {bag!r} ({tables[bag]!r}); "
                f"set data.seqrec.event_attrs >= 1"
            )
        slots[group] = names
    counts = {len(v) for v in slots.values()}
    max_ids = next(f.max_ids for f in schema.id_features if f.name == bag)
    if len(counts) != 1 or max_ids != counts.pop():
        raise ValueError(
            f"model.item_attributes=true: the candidate's bag {bag!r} holds up to {max_ids} attributes "
            f"but the events carry {[len(v) for v in slots.values()]}; set data.seqrec.max_attrs equal "
            f"to data.seqrec.event_attrs so that training and ranking score the same item"
        )
    return slots


def _distinct_runs(s: JaggedEmbeddings, users: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows equal to the row before them (same length, same event embeddings, same user tokens):
    ``keep`` (the first row of each run) and ``inverse`` (each row's run), or ``(None, None)``
    when no two neighbours are equal."""
    lengths = offsets_to_lengths(s.offsets)
    num_rows, total = lengths.numel(), s.values.shape[0]
    if num_rows < 2:
        return None, None
    same = torch.zeros(num_rows, dtype=torch.bool, device=lengths.device)
    same[1:] = lengths[1:] == lengths[:-1]
    for u in users:
        same[1:] &= (u[1:] == u[:-1]).all(1)
    seg = segment_ids(s.offsets, total)
    back = (torch.arange(total, device=lengths.device) - lengths[seg]).clamp_min(0)  # the row before's event
    differs = (s.values != s.values[back]).any(1).to(torch.int32)
    same &= torch.zeros(num_rows, dtype=torch.int32, device=lengths.device).index_add_(0, seg, differs) == 0
    if not bool(same.any()):
        return None, None
    inverse = torch.cumsum((~same).to(torch.int64), 0) - 1
    return (~same).nonzero().squeeze(1), inverse
