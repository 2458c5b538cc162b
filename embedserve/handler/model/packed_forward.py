"""A packed forward pass for BERT-family encoders: the real tokens of every input of a pass, one
after another, with no padding.

The padded path runs (batch, seq) tensors, so every Linear, LayerNorm and activation also
computes the padding. Here the inputs of a pass are concatenated:

    ids         (total,)    int64   the real tokens of all inputs, input after input
    cu_seqlens  (n + 1,)    int32   input i is ids[cu_seqlens[i]:cu_seqlens[i + 1]]; cu_seqlens[0] = 0
    max_len     int                 the longest input

and everything but attention runs on (total, hidden) tensors: position ids restart at each input,
and only attention needs to know where inputs begin and end. The pass reuses the loaded
Hugging Face model's own modules (embeddings, Linear, LayerNorm, activation), so its weights,
dtype and any quantized Linear are used as they are; what it replaces is the model's forward,
written against transformers 5.x's BertModel, RobertaModel, XLMRobertaModel and MPNetModel.

Attention (one small function, `attention_kernel`, names the kernel a device runs):
  - on CUDA in float16/bfloat16, torch.nn.attention.varlen's flash attention reads the packed
    tensors and cu_seqlens directly;
  - elsewhere (CPU, float32, MPNet's position bias), inputs of similar length are grouped and each
    group runs one padded scaled_dot_product_attention: only attention is padded, and only up to
    its group's longest input. On a 2-core CPU this measured fastest of the candidates
    (bench/packed.py): one SDPA call per input, SDPA over jagged nested tensors, one padded SDPA
    over the whole pass, and a block-diagonal mask over the whole pass.

Pooling (`pool_packed`) works on the packed states with segment reductions and matches
embedserve/handler/model/pooling.py's `pool` on the padded states: the same modes, in float32, with a per-input
count of leading prompt tokens left out of pooling.

The backend that plans, prepares and runs passes in this layout is
embedserve/handler/backends/packed.py; embedserve/handler/execution/select.py checks it against
the padded layout at start-up before a worker uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from embedserve.handler.model.description import POOLING_MODES
from embedserve.handler.worker.transfer import to_device

# The architectures whose forward this module reproduces, by exact class: a subclass may change it.
def supported() -> tuple[type, ...]:
    """The encoders packed here. Imported when a model is at hand, not with this module: transformers'
    modeling modules cost every worker's start about 1.7 s of CPU, which a worker that runs ONNX
    Runtime or OpenVINO never needs."""
    from transformers import BertModel, MPNetModel, RobertaModel, XLMRobertaModel

    return BertModel, RobertaModel, XLMRobertaModel, MPNetModel


VARLEN_FLASH = "varlen_flash"  # torch.nn.attention.varlen on CUDA
GROUPED_SDPA = "grouped_sdpa"  # length-grouped padded scaled_dot_product_attention, any device
# An input joins a group while it is at least this fraction of the group's longest input: a
# group then computes at most 1 / 0.7**2, about 2x, the query-key pairs its inputs need, while
# a pass of lengths 250, 12, 12, ... runs as two groups, not as one padded to 250.
GROUP_LENGTH_RATIO = 0.7


def packed_support(model: torch.nn.Module) -> str | None:
    """None if `model` can run packed; otherwise why not."""
    classes = supported()
    if type(model) not in classes:
        return f"{type(model).__name__} is not one of {', '.join(cls.__name__ for cls in classes)}"
    config = model.config
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "a decoder (causal or cross attention)"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":  # transformers 5 no longer implements relative_key(_query) here
        return f"position_embedding_type {position_type!r} (only absolute position embeddings)"
    if model.training:
        return "the model is in training mode (dropout); the packed pass is for inference: call .eval()"
    return None


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, position_bias: bool = False) -> str:
    """The attention kernel a packed pass on `device` in `dtype` runs. Flash attention takes half
    precision, head sizes that are multiples of 8 up to 256, no additive bias, and a GPU of compute
    capability 8.0 or newer; everything else runs the grouped SDPA."""
    flash = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not position_bias
             and head_dim % 8 == 0 and head_dim <= 256 and torch.cuda.get_device_capability(device) >= (8, 0))
    return VARLEN_FLASH if flash else GROUPED_SDPA


class Packed(NamedTuple):
    ids: torch.Tensor  # (total,) int64
    cu_seqlens: torch.Tensor  # (n + 1,) int32
    max_len: int


def pack(rows: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Packed:
    """Token ids per input -> the pass's packed ids and offsets on `device`."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if not len(rows) or lengths.min() < 1:
        raise ValueError("pack needs at least one input, each of at least one token")
    total = int(lengths.sum())
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total)
    cu_seqlens = np.zeros(len(rows) + 1, dtype=np.int32)  # int32: what flash attention reads
    np.cumsum(lengths, out=cu_seqlens[1:])
    device = torch.device(device)
    return Packed(to_device(ids, device), to_device(cu_seqlens, device), int(lengths.max()))


@dataclass(frozen=True)
class Segments:
    """Where each token of a pass sits: its input, and its position within that input."""
    starts: torch.Tensor  # (n,) int64: each input's first token
    lengths: torch.Tensor  # (n,) int64
    index: torch.Tensor  # (total,) int64: the input each token belongs to
    position: torch.Tensor  # (total,) int64: 0 at each input's first token

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, total: int) -> "Segments":
        offsets = cu_seqlens.long()
        starts, lengths = offsets[:-1], offsets.diff()
        # output_size: no device-to-host copy to learn the total on CUDA.
        index = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths,
                                        output_size=total)
        position = torch.arange(total, device=offsets.device) - starts[index]
        return cls(starts, lengths, index, position)


@dataclass(frozen=True)
class Group:
    """Inputs of similar length that run as one padded (count, heads, length, head_dim) attention."""
    count: int
    length: int  # the group's longest input
    span: slice | None  # the group's tokens when they already lie in the pass as (count, length)
    tokens: torch.Tensor | None  # (group total,) where the group's tokens sit in the pass
    slots: torch.Tensor | None  # (group total,) where they go in the (count * length) padded grid
    key_mask: torch.Tensor | None  # (count, 1, 1, length) True on real keys; None: no padding


def length_groups(cu_seqlens: torch.Tensor, ratio: float = GROUP_LENGTH_RATIO) -> list[Group]:
    """Group a pass's inputs, longest first, so a group's shortest is at least `ratio` times its
    longest. Built once per pass on the host (the offsets are copied there) for every layer."""
    offsets = cu_seqlens.cpu().numpy().astype(np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] > 0]  # zero-length inputs (a graph's unused slots) attend to nothing
    descending = lengths[order]
    device = cu_seqlens.device
    groups = []
    first = 0
    while first < len(order):
        # The first input (in descending order) shorter than ratio x this group's longest.
        end = int(np.searchsorted(-descending, -ratio * descending[first], side="right"))
        end = max(end, first + 1)
        members, sizes = order[first:end], descending[first:end]
        longest, count = int(sizes[0]), end - first
        equal = int(sizes[-1]) == longest
        if equal and np.all(np.diff(members) == 1):  # consecutive in the pass: a view, no copies
            begin = int(starts[members[0]])
            groups.append(Group(count, longest, slice(begin, begin + count * longest), None, None, None))
        else:
            local = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # 0.. within each
            tokens = np.repeat(starts[members], sizes) + local
            slots = np.repeat(np.arange(count) * longest, sizes) + local
            key_mask = None if equal else torch.from_numpy(
                (np.arange(longest) < sizes[:, None]).reshape(count, 1, 1, longest)).to(device)
            groups.append(Group(count, longest, None, torch.from_numpy(tokens).to(device),
                                torch.from_numpy(slots).to(device), key_mask))
        first = end
    return groups


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[Group], scale: float,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """(total, heads, head_dim) q, k, v -> (total, heads, head_dim), each input attending to itself
    only. `bias`: (heads, max_len, max_len) added to the scores (MPNet's relative positions)."""
    out = torch.empty_like(q)
    for group in groups:
        mask = group.key_mask  # (count, 1, 1, length) or None
        if bias is not None:  # -> (count or 1, heads, length, length)
            square = bias[:, :group.length, :group.length].unsqueeze(0)
            mask = square if mask is None else torch.where(mask, square, float("-inf"))
        context = F.scaled_dot_product_attention(_grid(q, group), _grid(k, group), _grid(v, group), attn_mask=mask,
                                                 scale=scale)  # (count, heads, length, head_dim)
        context = context.transpose(1, 2).flatten(0, 1)  # (count * length, heads, head_dim)
        if group.span is not None:
            out[group.span] = context
        else:
            out.index_copy_(0, group.tokens, context.index_select(0, group.slots))
    return out


def _grid(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(total, heads, head_dim) -> the group's (count, heads, length, head_dim), zeros past each input."""
    if group.span is not None:
        grid = x[group.span]
    else:
        grid = x.new_zeros(group.count * group.length, *x.shape[1:])
        grid.index_copy_(0, group.slots, x.index_select(0, group.tokens))
    return grid.view(group.count, group.length, *x.shape[1:]).transpose(1, 2)


def varlen_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_len: int, scale: float) -> torch.Tensor:
    """(total, heads, head_dim) -> (total, heads, head_dim): flash attention over the packed tensors,
    on CUDA in half precision. torch.nn.attention.varlen has no CPU kernel, so this runs only where
    attention_kernel chose it; the CPU-only test suite cannot run it."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale)


class Layer(NamedTuple):
    """One encoder layer as the model's own modules: the q, k, v projections, what turns the
    attention context and the residual into the attention block's output, and the feed-forward."""
    query: torch.nn.Module
    key: torch.nn.Module
    value: torch.nn.Module
    attention_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (context, residual) -> states
    intermediate: torch.nn.Module  # dense, then config.hidden_act (transformers' ACT2FN)
    output: torch.nn.Module  # (intermediate, residual) -> dense, residual, LayerNorm


def _mpnet_attention_output(attention: torch.nn.Module, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return attention.LayerNorm(attention.attn.o(context) + residual)  # MPNetAttention, dropout aside


def _layers(model: torch.nn.Module) -> list[Layer]:
    from transformers import MPNetModel

    if isinstance(model, MPNetModel):
        return [Layer(layer.attention.attn.q, layer.attention.attn.k, layer.attention.attn.v,
                      partial(_mpnet_attention_output, layer.attention), layer.intermediate, layer.output)
                for layer in model.encoder.layer]
    return [Layer(layer.attention.self.query, layer.attention.self.key, layer.attention.self.value,
                  layer.attention.output, layer.intermediate, layer.output) for layer in model.encoder.layer]


class PackedTransformer:
    """A supported Hugging Face encoder run packed: (total,) ids and offsets in, (total, hidden)
    last hidden states out, the same states the model computes for those tokens padded."""

    def __init__(self, model: torch.nn.Module):
        reason = packed_support(model)
        if reason is not None:
            raise ValueError(f"packed forward unsupported: {reason}")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.heads
        self.scale = 1 / math.sqrt(self.head_dim)  # BERT's scaling and MPNet's division alike
        self.layers = _layers(model)
        embeddings = model.embeddings
        self.device = embeddings.word_embeddings.weight.device
        self.dtype = embeddings.word_embeddings.weight.dtype
        from transformers import BertModel, MPNetModel

        # RoBERTa, XLM-R and MPNet count positions from padding_idx + 1, and skip padding ids.
        self.padding_idx = None if isinstance(model, BertModel) else embeddings.padding_idx
        self.position_bias = isinstance(model, MPNetModel)
        self.attention_kernel = attention_kernel(self.device, self.dtype, self.head_dim, self.position_bias)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
        """(total,) ids, (n + 1,) offsets, the longest input -> (total, hidden) states."""
        segments = Segments.of(cu_seqlens, ids.shape[0])
        states = self._embed(ids, segments)  # (total, hidden)
        attend = self._attention(cu_seqlens, max_len)
        for layer in self.layers:
            context = attend(self._heads(layer.query(states)), self._heads(layer.key(states)),
                             self._heads(layer.value(states)))
            states = layer.attention_output(context.flatten(1), states)
            states = layer.output(layer.intermediate(states), states)
        return states

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (total, hidden) -> (total, heads, head_dim)
        return x.view(x.shape[0], self.heads, self.head_dim)

    def _attention(self, cu_seqlens: torch.Tensor, max_len: int) -> Callable[..., torch.Tensor]:
        """The pass's attention: (total, heads, head_dim) q, k, v -> (total, heads, head_dim)."""
        if self.attention_kernel == VARLEN_FLASH:
            offsets = cu_seqlens.to(torch.int32)
            return partial(varlen_flash_attention, cu_seqlens=offsets, max_len=max_len, scale=self.scale)
        bias = None
        if self.position_bias:  # MPNet: its own bucketed relative position bias, (heads, max_len, max_len)
            shape_only = torch.empty(1, max_len, 0, device=self.device)
            bias = self.model.encoder.compute_position_bias(shape_only)[0].to(self.dtype)
        return partial(grouped_attention, groups=length_groups(cu_seqlens), scale=self.scale, bias=bias)

    def _embed(self, ids: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Word + token type 0 + position embeddings, then LayerNorm, in the order the model adds them."""
        embeddings = self.model.embeddings
        states = embeddings.word_embeddings(ids)
        if hasattr(embeddings, "token_type_embeddings"):  # MPNet has none; the others use type 0
            states = states + embeddings.token_type_embeddings.weight[0]
        states = states + embeddings.position_embeddings(self._positions(ids, segments))
        return embeddings.LayerNorm(states)

    def _positions(self, ids: torch.Tensor, segments: Segments) -> torch.Tensor:
        """(total,) position ids, restarting at each input."""
        if self.padding_idx is None:
            return segments.position
        # As the model's create_position_ids_from_input_ids, per input: non-padding tokens count
        # up from padding_idx + 1, a padding id keeps padding_idx.
        real = ids.ne(self.padding_idx).long()
        running = F.pad(real.cumsum(0), (1, 0))  # (total + 1,): real tokens before each token
        within = running[1:] - running[segments.starts][segments.index]
        return within * real + self.padding_idx


def pool_packed(hidden: torch.Tensor, cu_seqlens: torch.Tensor, unpooled: Sequence[int] | torch.Tensor | None,
                modes: Sequence[str]) -> torch.Tensor:
    """(total, hidden) packed states -> (n, hidden * len(modes)) float32, as embedserve/handler/model/pooling.py's
    `pool` on the same inputs padded. `unpooled[i]`: how many of input i's first tokens are left
    out of pooling (an excluded prompt; they were attended to)."""
    states = hidden.to(torch.float32)
    segments = Segments.of(cu_seqlens, hidden.shape[0])
    count, width = len(segments.lengths), hidden.shape[1]
    skipped = torch.zeros_like(segments.lengths) if unpooled is None else \
        torch.as_tensor(unpooled, dtype=torch.int64, device=hidden.device).clamp(max=segments.lengths)
    pooled = segments.position >= skipped[segments.index]  # (total,)
    weights = pooled.to(torch.float32).unsqueeze(1)  # (total, 1)
    pooled_count = (segments.lengths - skipped).to(torch.float32).clamp(min=1e-9).unsqueeze(1)  # (n, 1)

    def segment_sum(values: torch.Tensor) -> torch.Tensor:  # (total, k) -> (n, k)
        return values.new_zeros(count, values.shape[1]).index_add_(0, segments.index, values)

    outputs = []
    for mode in modes:
        if mode == "cls":  # the first pooled token; with none pooled, the first token, as pool's argmax gives
            first = segments.starts + torch.where(skipped < segments.lengths, skipped, 0)
            outputs.append(states[first.clamp(max=hidden.shape[0] - 1)])  # a zero-length input starts past the end
        elif mode == "max":
            candidates = states.masked_fill(~pooled.unsqueeze(1), float("-inf"))  # -inf: none pooled, as pool
            outputs.append(states.new_full((count, width), float("-inf")).scatter_reduce_(
                0, segments.index.unsqueeze(1).expand_as(candidates), candidates, "amax"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            outputs.append(segment_sum(states * weights) /
                           (pooled_count if mode == "mean" else pooled_count.sqrt()))
        elif mode == "weightedmean":  # token i of an input weighs i + 1, prompt included in the count
            weighted = weights * (segments.position + 1).to(torch.float32).unsqueeze(1)
            outputs.append(segment_sum(states * weighted) / segment_sum(weighted).clamp(min=1e-9))
        elif mode == "last_token":  # the input's last token; zeros when none is pooled
            last = segments.starts + segments.lengths - 1
            outputs.append(states[last] * (skipped < segments.lengths).to(torch.float32).unsqueeze(1))
        else:
            raise ValueError(f"unknown pooling mode '{mode}'; known: {', '.join(POOLING_MODES)}")
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


class PackedInputs(NamedTuple):
    """One packed pass as the encoder runs it; ids first, as for a padded pass."""
    ids: torch.Tensor  # (total,) int64
    cu_seqlens: torch.Tensor  # (n + 1,) int32
    max_len: int
    unpooled: torch.Tensor | None  # (n,) int64 leading tokens left out of pooling; None: all pooled
    # Late chunking: the pass's distinct rows are packed, and each span is pooled from its row's
    # states: (span tokens,) int64 positions in the pass, span after span, and their offsets
    # ((spans + 1,) int32); None: a row pooled per input.
    spans: tuple[torch.Tensor, torch.Tensor] | None = None
