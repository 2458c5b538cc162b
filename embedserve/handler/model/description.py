"""What a model is, as the model folder describes it: the types every wing reads (model/files.py
reads them off the folder).

sentence-transformers describes a model as a pipeline in `modules.json`: a Transformer (the
Hugging Face model), a Pooling module, then modules that transform the pooled vector (Dense,
LayerNorm, Normalize). A scoring model (a reranker or a classifier) is a sequence-classification
model whose own head gives one logit per label, or a causal language model reranker whose score is
a LogitScore over pairs rendered through its chat template. Task, decided once from the folder,
says which: each task has its slice in embedserve/handler/tasks/.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

# Pooling modes in sentence-transformers' order of concatenation (its legacy flags, oldest files),
# under this server's names.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "last_token",
}
POOLING_MODES = tuple(POOLING_FLAGS.values())

# Modules after pooling that this server applies (embedserve/handler/model/head.py), and modules that are the
# identity at inference.
HEAD_MODULES = ("Dense", "LayerNorm", "Normalize")
IDENTITY_MODULES = ("Dropout",)
# The feature the pooled vector travels under; a module reading another feature works on tokens.
SENTENCE_EMBEDDING = "sentence_embedding"


class Task(StrEnum):
    """What a model serves, decided once from its folder (ModelDescription.task): vectors, a
    relevance score per (query, document) pair, a score per label, or sparse lexical vectors. Each task has its slice
    (embedserve/handler/tasks/)."""
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    SPARSE = "sparse"  # a weight per vocabulary token (SPLADE)
    HYBRID = "hybrid"  # dense, sparse and multi-vector outputs from one pass (bge-m3)
    MULTI_VECTOR = "multi_vector"  # a vector per token, scored by MaxSim (ColBERT)


class ModelFilesError(ValueError):
    """A model folder is missing a file or describes something this server cannot do."""


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]  # concatenated in this order
    # False: prompt tokens are attended to but left out of pooling (INSTRUCTOR-style models).
    include_prompt: bool = True

    @property
    def name(self) -> str:
        return "+".join(self.modes)


@dataclass(frozen=True)
class HeadModule:
    """A module applied to the pooled vector, read from its folder."""
    kind: str  # one of HEAD_MODULES
    folder: str  # relative to the model folder; its weights are model.safetensors there
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogitScore:
    """A causal language model's score: the last token's logit of `true_token_id`, less that of
    `false_token_id` where there is one (sentence-transformers' LogitScore module)."""
    true_token_id: int
    false_token_id: int | None


@dataclass(frozen=True)
class ChatFormat:
    """How sentence-transformers renders a pair through the chat template: each message's content
    as a string ("flat") or as [{"type": "text", "text": ...}] ("structured"), the template's own
    keyword arguments, and whether a truncated row gets the template's closing tokens back."""
    message_format: str
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    restore_suffix: bool = True


@dataclass(frozen=True)
class Scoring:
    """A scoring head: its labels, and the activation sentence-transformers' CrossEncoder applies
    to the logits (a torch.nn class name). A sequence-classification model's own head gives the
    logits; a causal language model's come from `logit_score` over pairs rendered by `chat`."""
    labels: tuple[str, ...]  # by logit index; one label: a reranker
    activation: str  # "Sigmoid", "Identity", ...
    segments: bool  # the model takes token type ids: a pair's second text is its segment 1
    logit_score: LogitScore | None = None
    chat: ChatFormat | None = None

    @property
    def task(self) -> Task:
        return Task.RERANK if len(self.labels) == 1 else Task.CLASSIFY

    @property
    def own_head(self) -> bool:
        """Whether the model's own sequence-classification head gives the logits (no pooling)."""
        return self.logit_score is None


SPARSE_STRATEGIES = ("max", "sum")
SPARSE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SparsePooling:
    """SPLADE (sentence-transformers' SpladePooling after a masked-language model): each token's
    logit per vocabulary entry through log(1 + relu(x)) (log1p_relu: log1p once more), pooled over
    the input's tokens by max or sum: one weight per vocabulary entry, most of them zero."""
    strategy: str  # one of SPARSE_STRATEGIES
    activation: str  # one of SPARSE_ACTIVATIONS
    vocabulary: int  # the vector's width: the masked-language model's vocabulary
    # Inference-free queries: a query's vector is a weight per token it holds (SparseStaticEmbedding,
    # in the folder's query_static/), no transformer pass; documents go through SPLADE.
    static_query: bool = False

    @property
    def name(self) -> str:
        return f"SpladePooling({self.strategy}, {self.activation})"


@dataclass(frozen=True)
class M3Heads:
    """bge-m3's two heads beside its dense pipeline (FlagEmbedding's BGEM3): `sparse_linear`, a
    weight per token (relu), merged by token id with max and special tokens left out; and
    `colbert_linear`, a vector per token after the first, L2-normalized (ColBERT)."""
    colbert_dimension: int

    @property
    def modules(self) -> list[str]:
        return ["SparseLinear(relu, max by token id)", f"ColBERTLinear({self.colbert_dimension}, normalized)"]


@dataclass(frozen=True)
class QueryExpansion:
    """A ColBERT query padded with the mask token up to `length` tokens ("fixed": exactly, longer
    queries cut; "min": at least), the padding attended to or not."""
    strategy: str  # "fixed" or "min"
    length: int
    attend: bool
    token: str | None = None  # the padding token; None: the tokenizer's mask token, else its eos token


@dataclass(frozen=True)
class TokenPooling:
    """sentence-transformers' HierarchicalTokenPooling: an input's token vectors after the first
    `protected` clustered (Ward, on cosine distance) into len // pool_factor means."""
    pool_factor: float
    protected: int
    normalize: bool
    tasks: tuple[str, ...]  # the input types pooled ("document"; no type counts as document)


@dataclass(frozen=True)
class MultiVector:
    """A sentence-transformers MultiVectorEncoder (ColBERT): per input, a vector per token (the
    Transformer's states through its Dense modules, L2-normalized), queries and documents told
    apart by their prompts, lengths, query expansion and the skiplist (MultiVectorMask)."""
    query_length: int | None
    document_length: int | None
    expansion: QueryExpansion | None
    skiplist_words: tuple[str, ...]
    skiplist_tasks: tuple[str, ...]  # "query", "document": where the skiplist applies (no task counts as document)
    similarity: str  # "maxsim", or "meanmaxsim" (divided by the query's tokens)
    token_pooling: TokenPooling | None = None
    prefixes: tuple[tuple[str, str], ...] = ()  # PyLate's query_prefix / document_prefix, ahead of the prompts

    def longest(self, plain: int) -> int:
        """The most tokens an input of some type keeps, where `plain` is what an input of no type
        keeps (max_seq_length): sentence-transformers applies query_length, document_length and a
        query expansion's length over max_seq_length, not within it."""
        return max(plain, self.query_length or 0, self.document_length or 0,
                   self.expansion.length if self.expansion else 0)


@dataclass(frozen=True)
class Towers:
    """An image-text dual encoder (CLIP, SigLIP, SigLIP 2; model/towers.py): a text and a vision tower projecting into one space."""
    architecture: str  # CLIPModel, SiglipModel, Siglip2Model
    dimension: int  # the shared space's width
    text_positions: int  # the text tower's position table
    image_positions: int  # the patches the vision tower computes an image (NaFlex: what each is padded to)
    text_length: int | None = None  # SigLIP's: every text padded to this length, its last position pooled
    own_grid: bool = False  # SigLIP 2 NaFlex: an image keeps its aspect ratio, a grid of patches of its own

    @property
    def modules(self) -> list[str]:
        if self.own_grid:
            return [f"TextTower(last of {self.text_length} padded positions, head)",
                    f"ImageTower(aspect ratio kept, up to {self.image_positions} patches, attention pooling head)"]
        if self.text_length:
            return [f"TextTower(last of {self.text_length} padded positions, head)", "ImageTower(attention pooling head)"]
        return ["TextTower(end-of-text token, text_projection)", "ImageTower(class token, visual_projection)"]


@dataclass(frozen=True)
class Pages:
    """A page retriever (ColPali, ColQwen2; model/pages.py): a vision-language model giving a
    vector per position of a page image (its image tokens and the visual prompt) or of a query."""
    architecture: str  # ColPaliForRetrieval, ColQwen2ForRetrieval
    family: str  # "colpali", "colqwen2": how the processor writes a page's and a query's ids
    dimension: int  # a vector's width
    image_tokens: int  # the positions a page image's patches take; where its size varies, at the pixel bound
    text_positions: int  # the language model's position table
    visual_prompt: str  # ColPali: after a page's image tokens; ColQwen2: the page's text, its image token in it
    query_prefix: str  # before a query's text
    image_token: str = "<image>"
    # Patches merged into one image token along each side where a page keeps its own size
    # (ColQwen2: Qwen2-VL's merge_size, 2x2 patches a token); 0 where every page is resized to one.
    merge: int = 0

    @property
    def modules(self) -> list[str]:
        tokens = f"image tokens by a page's size, {self.image_tokens} at its pixel bound" if self.merge else \
            f"{self.image_tokens} image tokens a page"
        return [f"PageEncoder(vision-language model, {tokens})", f"Linear(->{self.dimension})",
                "Normalize(per position)", "maxsim"]


@dataclass(frozen=True)
class ModelDescription:
    model_type: str  # config.json's model_type: bert, xlm-roberta, qwen3, ...
    hidden_size: int  # the transformer's output width
    pooling: Pooling | None  # None when the folder does not say
    max_seq_length: int | None
    usable_positions: int | None  # None when the architecture has no absolute position table
    head: tuple[HeadModule, ...] = ()
    do_lower_case: bool = False  # the Transformer module lowercases text before tokenizing
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    scoring: Scoring | None = None  # a reranker's or classifier's head; None for an embedding model
    sparse: SparsePooling | None = None  # a SPLADE model's pooling; None for a dense one
    m3: M3Heads | None = None  # bge-m3's sparse and ColBERT heads beside the dense pipeline
    multi_vector: MultiVector | None = None  # a ColBERT model's token pipeline
    # A causal language model's architecture (Qwen3ForCausalLM, ...) where no Pooling module says
    # how to pool it: the mean the folder would get is no vector its makers meant (below).
    unpooled_decoder: str | None = None
    towers: Towers | None = None  # an image-text model's two towers; None for a text model
    pages: Pages | None = None  # a page retriever's facts (its multi_vector too: scored by MaxSim)

    @property
    def reads_images(self) -> bool:
        return self.towers is not None or self.pages is not None

    @property
    def task(self) -> Task:
        if self.multi_vector:
            return Task.MULTI_VECTOR
        if self.sparse:
            return Task.SPARSE
        if self.m3:
            return Task.HYBRID
        return self.scoring.task if self.scoring else Task.EMBED

    def served_with(self, pooling_setting: str) -> "ModelDescription":
        """The description as served: the handler's `pooling` setting ("auto" or a mode) resolved
        against the model's own Pooling module (mean where it has none). A causal reranker's
        score is read at the last token whatever the setting; a sparse model pools its own way,
        over every token (named as its pooling, for /info)."""
        if self.scoring and self.scoring.logit_score:
            return self
        if self.towers:  # each tower pools its own way (model/towers.py)
            if pooling_setting != "auto":
                raise ModelFilesError(f"pooling '{pooling_setting}' does not apply to {self.towers.architecture}: "
                                      "each of its towers pools its own way")
            return replace(self, pooling=Pooling(("the towers' own",)))
        if self.sparse:
            return replace(self, pooling=Pooling((self.sparse.name,)))
        if self.multi_vector:  # every token (a page's every position) is an output: nothing to pool
            return replace(self, pooling=Pooling(("none: a vector per token",)))
        if self.unpooled_decoder and pooling_setting == "auto":
            # sentence-transformers would take the mean of a bare folder's token states: for a
            # decoder that is neither an embedder's vector (they read the last token) nor a
            # reranker's score (Qwen3-Reranker as published), and it would pass the build's check.
            raise ModelFilesError(
                f"config.json names {self.unpooled_decoder}, a causal language model, and the folder has no "
                "sentence-transformers files (modules.json with a Pooling module) saying how to make a vector of it; "
                "the mean of its token states that sentence-transformers would take is no vector its makers meant. "
                "An embedding model: add its modules.json and Pooling config, or build with --pooling (last_token "
                "for most decoder embedders). A reranker such as Qwen3-Reranker: build its sentence-transformers "
                "conversion (a Transformer and a LogitScore module; docs/models.md)")
        pooling = self.pooling or Pooling(("mean",))
        if pooling_setting != "auto":
            pooling = Pooling((pooling_setting,), include_prompt=pooling.include_prompt)
        return replace(self, pooling=pooling)

    @property
    def dimension(self) -> int:
        """The served vector's width: the last Dense module's, else the pooled one; a scoring
        model's logits per input."""
        if self.scoring:
            return len(self.scoring.labels)
        if self.sparse:
            return self.sparse.vocabulary
        if self.towers:
            return self.towers.dimension
        if self.pages:
            return self.pages.dimension
        widths = [m.config["out_features"] for m in self.head if m.kind == "Dense"]
        return widths[-1] if widths else self.hidden_size * len((self.pooling or Pooling(("mean",))).modes)

    @property
    def modules(self) -> list[str]:
        """The pipeline as applied, for reports and /info."""
        if self.scoring and self.scoring.logit_score:
            score = self.scoring.logit_score
            versus = f" - logit[{score.false_token_id}]" if score.false_token_id is not None else ""
            return ["Transformer(causal LM, chat template)", "Pooling(last_token)",
                    f"LogitScore(logit[{score.true_token_id}]{versus})", self.scoring.activation]
        if self.scoring:
            return [f"SequenceClassification({len(self.scoring.labels)} labels)", self.scoring.activation]
        if self.towers:
            return self.towers.modules
        if self.pages:
            return self.pages.modules
        if self.sparse:
            query = ["SparseStaticEmbedding(queries)"] if self.sparse.static_query else []
            return [*query, "Transformer(masked LM)", self.sparse.name]
        if self.multi_vector:
            skip = f"MultiVectorMask({len(self.multi_vector.skiplist_words)} skiplist words)"
            pooling = self.multi_vector.token_pooling
            pooled = [f"HierarchicalTokenPooling({pooling.pool_factor:g})"] if pooling else []
            return ["Transformer", *(describe_head_module(m) for m in self.head if m.kind != "Normalize"), skip,
                    "Normalize(per token)", *pooled, self.multi_vector.similarity]
        pooling = [f"Pooling({self.pooling.name}{'' if self.pooling.include_prompt else ', prompt excluded'})"] \
            if self.pooling else []
        return ["Transformer", *pooling, *(describe_head_module(m) for m in self.head), *(self.m3.modules if self.m3
                                                                                        else [])]


def describe_head_module(module: HeadModule) -> str:
    if module.kind == "Dense":
        activation = str(module.config.get("activation_function") or "Tanh").rsplit(".", 1)[-1]
        residual = ", residual" if module.config.get("use_residual") else ""
        return f"Dense({module.config['in_features']}->{module.config['out_features']}, {activation}{residual})"
    if module.kind == "LayerNorm":
        return f"LayerNorm({module.config['dimension']})"
    return module.kind
