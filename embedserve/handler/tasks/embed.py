"""The embed task: texts (or token ids) in, one vector per input out, shaped as each request asks.

Its request type and options (read off the wire by the native, OpenAI and TEI route families),
its preparation (every check before the model, the prompt, the token ids, truncation), its
answer's size bound, and its result: the vectors cut to `dimensions`, normalized, quantized.

Preparation: each request is checked on its own, so a bad one becomes its own error and takes no
part in the forward pass; the texts of all good requests are tokenized in one call, then each
request's lengths and tokens are checked on its own. Shaping (Matryoshka dimensions, then
normalization) runs on all requests of a batch together, quantizing on each alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from embedserve.handler.api.codec import as_int, json_type, option_value, short
from embedserve.handler.api.errors import RequestError, internal_error, malformed, unprocessable
from embedserve.handler.api.quantize import OUTPUT_DTYPES, SCALAR_DTYPES, quantize
from embedserve.handler.api.route import Route
from embedserve.handler.inputs.image import EncodedImage, ImageReader, ImageUrl, check_count, read_image
from embedserve.handler.inputs.text import BatchTokenizing, Input
from embedserve.handler.model.description import Task
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.scheduling.admission import WorkBudget
from embedserve.handler.tasks.base import Job, Outcome, RequestChecks
from embedserve.handler.tasks.chunking import (SPAN_POOLING, Span, char_spans, check_overlap, check_room, chunk_inputs,
                                               fixed_spans, late_chunk, max_overlap, pool_windows, text_room)
from embedserve.handler.worker.failures import log_failure

ENCODING_FORMATS = ("float", "base64")
TRUNCATION_DIRECTIONS = ("right", "left")
# An input longer than the model: cut to its length (truncate: false refuses it), or cut into
# windows of the model's length, each embedded, their vectors combined, or late chunked: a vector
# per span of one pass (chunking.py).
LONG_INPUTS = ("truncate", "chunk", "late_chunk")
# Late chunking's span when the request gives none: tokens of text.
DEFAULT_CHUNK_SIZE = 256
# What a request's inputs are (Infinity's field): texts, or images for a model that reads them.
MODALITIES = ("text", "image")
# Cohere's input types, and the prompt names each takes where the model has one (the first it has).
INPUT_TYPE_PROMPTS = {"search_query": ("query", "search_query"),
                      "search_document": ("document", "passage", "search_document"),
                      "classification": ("classification",), "clustering": ("clustering",), "image": ()}

# Every option of an embedding request, parsed alike on every route: its JSON type and, for a
# string, its values (the first is the default; none listed: any string). A missing field or null
# means the default. The OpenAPI document (routes/openapi.py) is built from this table.
OPTION_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    "normalize": (bool, ()),
    "truncate": (bool, ()),
    "truncation_direction": (str, TRUNCATION_DIRECTIONS),
    "prompt_name": (str, ()),
    "dimensions": (int, ()),  # a positive integer
    "output_dtype": (str, OUTPUT_DTYPES),
    "encoding_format": (str, ENCODING_FORMATS),
    "add_special_tokens": (bool, ()),  # /tokenize only
    "long_input": (str, LONG_INPUTS),
    "chunk_overlap": (int, ()),  # tokens each window repeats of the one before (0 and up)
    "chunk_size": (int, ()),  # late chunking: tokens of text a span
    "chunk_spans": (list, ()),  # late chunking: each input's [start, end) character ranges
    "modality": (str, MODALITIES),  # what the inputs are: texts, or images as data URIs (inputs/image.py)
}
# Integer options that may be 0 (the others must be positive).
INT_MINIMUMS = {"chunk_overlap": 0}
# Options whose values are matched in any case: TEI clients send "Left" and "Right".
CASE_INSENSITIVE = ("truncation_direction",)
# OpenAI's request fields the URL makes needless: checked to be strings, then ignored.
IGNORED_FIELDS = ("model", "user")

@dataclass(frozen=True)
class Options:
    # None means the server's setting.
    normalize: bool | None = None
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    dimensions: int | None = None  # Matryoshka truncation
    output_dtype: str = "float"
    encoding_format: str = "float"
    add_special_tokens: bool = True  # /tokenize only
    long_input: str = "truncate"
    chunk_overlap: int = 0
    chunk_size: int | None = None  # None: DEFAULT_CHUNK_SIZE, or a window's text where less
    chunk_spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    modality: str = "text"
    input_type: str | None = None  # Cohere's (routes/cohere.py): chooses a prompt the model has, below


@dataclass(frozen=True)
class EmbeddingRequest:
    route: Route
    inputs: tuple[Input, ...] = ()
    options: Options = field(default_factory=Options)
    # The JSON field the inputs came from, to name it in errors ("input" or "inputs").
    field: str = "input"

    def param(self, index: int) -> str:
        """Input `index`'s place in the body, for errors: /similarity's input 0 is its source."""
        if self.route is Route.TEI_SIMILARITY:
            return "inputs.source_sentence" if index == 0 else f"inputs.sentences[{index - 1}]"
        return f"{self.field}[{index}]"


@dataclass(frozen=True)
class Embeddings:
    """An embedding request's result: its vectors in the requested dtype, and its tokens."""
    vectors: np.ndarray  # (inputs, dimensions) float32, or codes
    tokens: int
    windows: tuple[int, ...] | None = None  # with "long_input": "chunk", the windows each input used
    # With "long_input": "late_chunk": each input's spans, whose vectors `vectors` holds in order.
    spans: tuple[tuple[Span, ...], ...] | None = None


# --- reading the request ---------------------------------------------------------------------------

def refuse_long_input(payload: dict[str, Any], kind: str) -> None:
    """Outputs other than one dense vector an input (sparse weights, token vectors) are not combined
    over windows: a model of `kind` cuts long inputs to its length, or refuses them."""
    value = payload.get("long_input")
    if value is not None and value != LONG_INPUTS[0]:
        raise unprocessable(f"'long_input' {short(value)} applies to the dense vectors of embedding models; a {kind} "
                            "model cuts a long input to its length (\"truncate\": false refuses it instead)",
                            param="long_input")


def refuse_images(payload: dict[str, Any], kind: str) -> None:
    """A model of `kind` that reads texts alone, and parses options of its own, refuses image inputs
    (which it would otherwise read as texts)."""
    value = payload.get("modality")
    if value is not None and value != MODALITIES[0]:
        raise unprocessable(f"'modality' {short(value)}: a {kind} model reads texts only", param="modality")


# A request's options are read in this order (so that of two bad ones, the same is named first);
# those it does not send are left at their defaults without a check.
DEFAULT_OPTIONS = Options()
OPTION_FIELDS = (*IGNORED_FIELDS, *OPTION_TYPES)


def parse_options(payload: dict[str, Any]) -> Options:
    sent = [key for key in OPTION_FIELDS if key in payload]
    if not sent:  # most requests: {"input": ...}
        return DEFAULT_OPTIONS
    values = {}
    for key in sent:
        if key in IGNORED_FIELDS:
            option_value(payload, key, str)
        elif key == "chunk_spans":
            values[key] = parse_spans(payload[key])
        else:
            kind, choices = OPTION_TYPES[key]
            values[key] = option_value(payload, key, kind, choices, key in CASE_INSENSITIVE, INT_MINIMUMS.get(key, 1))
    return Options(**{key: value for key, value in values.items() if value is not None})


def parse_spans(value: Any) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """`chunk_spans`: for each input, a non-empty list of [start, end) character ranges. Their
    type only, as for every option: what they must be against the inputs is the embed task's."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise malformed(f"'chunk_spans' must be a non-empty list (a list of [start, end] character ranges per "
                        f"input), got {json_type(value)}", param="chunk_spans")
    parsed = []
    for i, ranges in enumerate(value):
        if not isinstance(ranges, list) or not ranges:
            raise malformed(f"'chunk_spans[{i}]' must be a non-empty list of [start, end] character ranges, got "
                            f"{json_type(ranges)}", param=f"chunk_spans[{i}]")
        spans = []
        for j, pair in enumerate(ranges):
            bounds = [as_int(number) for number in pair] if isinstance(pair, list) and len(pair) == 2 else None
            if bounds is None or None in bounds or min(bounds) < 0:
                raise malformed(f"'chunk_spans[{i}][{j}]' must be [start, end], two non-negative integers, got "
                                f"{short(pair)}", param=f"chunk_spans[{i}][{j}]")
            spans.append((bounds[0], bounds[1]))
        parsed.append(tuple(spans))
    return tuple(parsed)


def _modality(request: Any) -> str:
    """What a request's inputs are; a task's own options without the field (sparse) take texts."""
    return getattr(request.options, "modality", MODALITIES[0])


# --- the answer's size -----------------------------------------------------------------------------

# The most bytes one number takes in a JSON answer, its separator included: orjson writes a
# float32 in at most 16 characters ("-0.0000053924714"), an int8 code in 4 ("-128").
_FLOAT_JSON_BYTES = 17
_CODE_JSON_BYTES = 5
# Bytes around each vector ({"object":"embedding","index":4095,"embedding":...},) and around the
# list (object, model, usage), with room to spare.
_ROW_OVERHEAD_BYTES = 64
_LIST_OVERHEAD_BYTES = 256


def max_answer_bytes(count: int, dimensions: int, output_dtype: str, encoding_format: str,
                     model_name: str = "", route: Route | None = None) -> int:
    """An upper bound of the bytes an embedding answer of `count` vectors takes on `route` (None:
    any route), computed before embedding: what must fit the server's largest answer."""
    values = -(-dimensions // 8) if output_dtype in ("binary", "ubinary") else dimensions
    if encoding_format == "base64":
        row = 4 * -(-values * base64_value_bytes(output_dtype, route) // 3)
    else:
        row = values * (_FLOAT_JSON_BYTES if output_dtype == "float" else _CODE_JSON_BYTES)
    return count * (row + _ROW_OVERHEAD_BYTES) + _LIST_OVERHEAD_BYTES + len(model_name)


def base64_value_bytes(output_dtype: str, route: Route | None) -> int:
    """Bytes one value takes before base64: 4 (float32) for floats, and for codes on the OpenAI
    route, whose clients decode base64 as float32 whatever was asked; 1 for codes elsewhere."""
    return 4 if output_dtype == "float" or route in (None, Route.OPENAI) else 1


# --- the slice -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # its tokens without special tokens: what truncation never cuts
    unpooled: int  # what pooling leaves out: 0 unless the Pooling module excludes the prompt


class _Checked(NamedTuple):
    """A valid embedding request before tokenizing: the texts it needs tokenized. (One is made a
    request: a named tuple costs a fraction of a frozen dataclass, which sets each field through
    object.__setattr__.)"""
    request: EmbeddingRequest
    normalize: bool
    prompt: Prompt
    texts: dict[int, str]  # input index -> prompt + text, for the tokenizer
    bodies: list[list[int] | None]  # token ids without special tokens; None where `texts` holds the input
    images: dict[int, ModelInput]  # input index -> its prepared image


class EmbedTask:
    task = Task.EMBED

    def __init__(self, checks: RequestChecks, *, prompts: dict[str, str], default_prompt: str, include_prompt: bool,
                 pooling: tuple[str, ...] = ("mean",), images: ImageReader | None = None):
        """`include_prompt`: whether pooling counts the prompt's tokens (the Pooling module's own flag);
        `pooling`: its modes (late chunking needs pooling over tokens); `images`: the image kind of a
        model that reads images (an image-text model's), None for a text model."""
        self.checks = checks
        self.images = images
        self.pooling = pooling
        self.pools_spans = set(pooling) <= set(SPAN_POOLING)  # whether it late chunks
        self.settings = checks.settings
        self.tokenizer = checks.tokenizer
        self.prompts = prompts
        self.default_prompt = default_prompt
        self._include_prompt = include_prompt
        self._prompt_tokens = {text: self._measure_prompt(text) for text in {default_prompt, *prompts.values()}}
        # The largest "chunk_overlap" whatever the prompt: one below the text a window holds beside
        # the model's longest prompt (a bound of the model, the OpenAPI document's maximum).
        self.max_chunk_overlap = max_overlap(self.tokenizer, self.max_length,
                                             max(prompt.tokens for prompt in self._prompt_tokens.values()))
        self.max_chunk_size = self.max_chunk_overlap + 1  # a window's text beside the longest prompt

    @property
    def max_length(self) -> int:
        return self.checks.max_length

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        return self.checks.text.token_ids(texts)

    def _measure_prompt(self, text: str) -> Prompt:
        if not text:
            return Prompt("", 0, 0)
        return Prompt(text, tokens=len(self.tokenizer.body_ids([text])[0]),
                      unpooled=0 if self._include_prompt else self.tokenizer.prompt_length(text))

    def prepare(self, requests: dict[int, EmbeddingRequest], budget: WorkBudget | None
                ) -> dict[int, Job | RequestError]:
        outcomes: dict[int, Job | RequestError] = {}
        checked: dict[int, _Checked] = {}
        for index, request in requests.items():
            try:
                checked[index] = self._check(request)
            except RequestError as err:
                outcomes[index] = err
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                outcomes[index] = internal_error()
        outcomes.update(self._tokenize(checked, budget))
        return dict(sorted(outcomes.items()))

    def _check(self, request: EmbeddingRequest) -> _Checked:
        """Every check before tokenizing: limits, options, prompt, token ids; and the texts to
        tokenize: `prompt + text`, tokenized as one string, as sentence-transformers does. With a
        prompt, token-id inputs are the text they decode to, so that both forms of one text give
        the same vector. Images (under "modality": "image", or item objects) are prepared here."""
        options = request.options
        normalize = self.settings.normalize if options.normalize is None else options.normalize
        images = self._image_items(request)
        if images:
            self._check_images(request, images)
        self.check_limits(request, images)
        self._check_options(request, normalize)
        prompt = self._prompt_of(request)
        texts: dict[int, str] = {}
        bodies: list[list[int] | None] = []
        for i, item in enumerate(request.inputs):
            if i in images:
                bodies.append(None)
            elif isinstance(item, str):
                texts[i] = prompt.text + item
                bodies.append(None)
            else:
                self.checks.text.vocabulary(item, f"{request.field}[{i}]")
                if prompt.text:
                    texts[i] = prompt.text + self.tokenizer.decode(item)
                bodies.append(None if prompt.text else list(item))
        prepared = self.images.model_inputs(list(images.values())) if images else []
        return _Checked(request, normalize, prompt, texts, bodies, dict(zip(images, prepared)))

    def _image_items(self, request: EmbeddingRequest) -> dict[int, tuple[EncodedImage | ImageUrl, str]]:
        """The request's image items by index, each with its name: under "modality": "image" every
        input, read as an image; else the item objects that said they are images."""
        if _modality(request) != "image":
            return {i: (item, f"{request.param(i)}.{item.key}" if item.key else request.param(i))
                    for i, item in enumerate(request.inputs) if isinstance(item, (EncodedImage, ImageUrl))}
        images = {}
        for i, item in enumerate(request.inputs):
            if not isinstance(item, str):
                raise malformed(f"'{request.param(i)}' must be an image as a data URI string, got token ids",
                                param=request.param(i))
            images[i] = (read_image(item, request.param(i)), request.param(i))
        return images

    def _check_images(self, request: EmbeddingRequest, images: dict[int, tuple[Any, str]]) -> None:
        """A request with images (the image kind, inputs/image.py): a model that reads them, a route
        that answers them, the options that shape texts alone refused (their count and bytes:
        check_limits, with the texts beside them)."""
        param = "modality" if _modality(request) == "image" else next(iter(images.values()))[1]
        if self.images is None:
            raise unprocessable(f"'{param}': images need a model that reads images; this one reads texts", param=param)
        if request.route not in (Route.NATIVE, Route.OPENAI, Route.EMBED_V2):
            raise unprocessable(f"'{param}': images are for the native, OpenAI and Cohere routes; TEI's take texts",
                                param=param)
        options = request.options
        if options.long_input != LONG_INPUTS[0]:
            raise unprocessable("'long_input' applies to texts alone, and this request has images",
                                param="long_input")
        if options.prompt_name is not None and len(images) == len(request.inputs):
            raise unprocessable("'prompt_name' applies to texts, and these inputs are images", param="prompt_name")

    def _tokenize(self, checked: dict[int, _Checked], budget: WorkBudget | None) -> dict[int, Job | RequestError]:
        """The checked requests' texts tokenized in one call, then each request finished on its
        own: a request over a token limit gets its error, the others go on."""
        tokenized = BatchTokenizing(self.tokenizer, [list(pending.texts.values()) for pending in checked.values()])
        outcomes: dict[int, Job | RequestError] = {}
        for group, (index, pending) in enumerate(checked.items()):
            try:
                outcomes[index] = self._finish(pending, tokenized.body_ids(group), budget)
            except RequestError as err:
                outcomes[index] = err
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                outcomes[index] = internal_error()
        return outcomes

    def _finish(self, checked: _Checked, tokenized: list[list[int]], budget: WorkBudget | None) -> Job:
        """The checks after tokenizing, given the token ids of `checked.texts` in order: length
        per input (truncated, or refused with truncation off) and tokens per request."""
        request, prompt = checked.request, checked.prompt
        options = request.options
        bodies = list(checked.bodies)
        for i, ids in zip(checked.texts, tokenized):
            bodies[i] = ids
        max_length = self.checks.max_length
        if options.long_input == "late_chunk":
            return self._late_chunked(checked, bodies, budget)
        if options.long_input == "chunk":
            chunked = chunk_inputs(self.tokenizer, bodies, max_length, prompt.tokens, options.chunk_overlap)
            inputs = [ModelInput(ids, unpooled=prompt.unpooled) for ids in chunked.ids]
            self.checks.tokens(sum(len(item) for item in inputs), request.field, budget)
            return Job(request, inputs, checked.normalize, windows=chunked.windows, weights=chunked.weights)
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        assembled = {i: self.tokenizer.assemble(body, max_length, options.truncation_direction, keep=prompt.tokens)
                     for i, body in enumerate(bodies) if i not in checked.images}
        for i, item in assembled.items():
            self.checks.text.length(request.param(i), item.full_length, truncate)
        inputs = [checked.images[i] if i in checked.images else ModelInput(assembled[i].ids, unpooled=prompt.unpooled)
                  for i in range(len(bodies))]
        self.checks.tokens(sum(len(item) for item in inputs), request.field, budget)
        return Job(request, inputs, checked.normalize)

    def _late_chunked(self, checked: _Checked, bodies: list[list[int]], budget: WorkBudget | None) -> Job:
        """A model input per span of each input (chunking.py), and each span's token and
        character ranges in its text (characters: where the input was a text)."""
        request, prompt, options = checked.request, checked.prompt, checked.request.options
        room = text_room(self.tokenizer, self.max_length, prompt.tokens)
        size = options.chunk_size or min(DEFAULT_CHUNK_SIZE, room)
        texts = {i: item for i, item in enumerate(request.inputs) if isinstance(item, str)}
        offsets = dict(zip(texts, self.tokenizer.body_offsets([prompt.text + text for text in texts.values()])))
        cut: list[tuple[list[int], list[tuple[int, int]], list[tuple[int, int]] | None]] = []
        for i, body in enumerate(bodies):
            places = None  # token ids have no characters
            if i in offsets:  # the text's own tokens, as late_chunk cuts them: the same ids, with offsets
                body, places = offsets[i]
                places = [(start - len(prompt.text), end - len(prompt.text)) for start, end in places[prompt.tokens:]]
            if options.chunk_spans is not None:
                ranges = options.chunk_spans[i]
                for j, (start, end) in enumerate(ranges):
                    if start >= end:
                        raise unprocessable(f"'chunk_spans[{i}][{j}]' [{start}, {end}) is empty: a range needs start "
                                            "< end", param=f"chunk_spans[{i}][{j}]")
                    if end > len(texts[i]):
                        raise unprocessable(f"'chunk_spans[{i}][{j}]' ends at character {end}, past the end of "
                                            f"'{request.param(i)}' ({len(texts[i])} characters)",
                                            param=f"chunk_spans[{i}][{j}]")
                token_spans = char_spans(ranges, places, f"chunk_spans[{i}]")
            else:
                token_spans = fixed_spans(len(body) - prompt.tokens, size)
            cut.append((body, token_spans, places))
        self._check_answer_size(request, sum(len(token_spans) for _, token_spans, _ in cut))
        inputs: list[ModelInput] = []
        spans: list[tuple[Span, ...]] = []
        for i, (body, token_spans, places) in enumerate(cut):
            inputs += late_chunk(self.tokenizer, body, token_spans, self.max_length, prompt.tokens,
                                 options.chunk_overlap, f"chunk_spans[{i}]" if options.chunk_spans else "chunk_size",
                                 prompt.unpooled)
            spans.append(tuple(Span((first, last), (places[first][0], places[last - 1][1])
                                    if places is not None and last > first else None) for first, last in token_spans))
        job = Job(request, inputs, checked.normalize, windows=tuple(map(len, spans)), spans=tuple(spans))
        self.checks.tokens(job.tokens, request.field, budget)
        return job

    def check_limits(self, request: EmbeddingRequest, images: dict[int, tuple[Any, str]] | None = None) -> None:
        """Input count, the count and bytes of the `images` among them (by index, as _image_items
        gives them), and characters per text: before any tokenizing or decoding."""
        images = images or {}
        self.checks.count(request)
        if images:
            check_count([image for image, _ in images.values()], request.field, self.images.limits)
        for i, item in enumerate(request.inputs):
            if isinstance(item, str) and i not in images:
                self.checks.text.chars(item, request.param(i))

    def _check_options(self, request: EmbeddingRequest, normalize: bool, answer: bool = True) -> None:
        """The options' values, and with `answer` the answer's size bound."""
        options, dimension = request.options, self.checks.dimension
        check_overlap(options.chunk_overlap, self.max_chunk_overlap, self.checks.max_length)
        self._check_late_chunking(request)
        if options.long_input in ("chunk", "late_chunk"):
            check_room(self.tokenizer, self.checks.max_length, self._prompt_of(request).tokens)
        if options.dimensions is not None and options.dimensions > dimension:
            raise unprocessable(f"'dimensions' must be at most the model's dimension {dimension}, "
                                f"got {options.dimensions}", param="dimensions")
        if answer:
            self._check_answer_size(request)
        # Only the answer's own normalization makes unit vectors: the pipeline's final Normalize
        # is left to it (model/head.py), so `normalize: false` gives vectors of any length.
        if options.output_dtype in SCALAR_DTYPES and not normalize:
            raise unprocessable(f"'output_dtype' {options.output_dtype} quantizes the range [-1, 1] of "
                                "normalized vectors; with \"normalize\": false they are not unit length: drop "
                                "\"normalize\": false or use float/binary", param="output_dtype")

    def _check_late_chunking(self, request: EmbeddingRequest) -> None:
        """Late chunking's options, checked on every request as every option is; its own needs
        (pooling over tokens, an answer shape with spans, texts for character ranges) where asked."""
        options = request.options
        if options.chunk_size is not None and options.chunk_size > self.max_chunk_size:
            raise unprocessable(f"'chunk_size' must be at most {self.max_chunk_size}, the tokens of text a window "
                                f"holds beside the model's longest prompt, got {options.chunk_size}",
                                param="chunk_size")
        if options.long_input != "late_chunk":
            if options.chunk_spans is not None:
                raise unprocessable("'chunk_spans' applies to \"long_input\": \"late_chunk\"", param="chunk_spans")
            return
        if not self.pools_spans:
            raise unprocessable(f"\"long_input\": \"late_chunk\" pools the tokens of each span, and this model pools "
                                f"{'+'.join(self.pooling)}, which has no vector for a span (late chunking needs "
                                f"{', '.join(SPAN_POOLING)} pooling)", param="long_input")
        if request.route not in (Route.NATIVE, Route.OPENAI):
            raise unprocessable("\"long_input\": \"late_chunk\" answers a vector per span, which TEI's answer (a "
                                "vector per input) cannot hold: use the OpenAI or native route", param="long_input")
        if options.chunk_spans is not None:
            self._check_answer_size(request, sum(map(len, options.chunk_spans)))  # before any work on the ranges
            if len(options.chunk_spans) != len(request.inputs):
                raise unprocessable(f"'chunk_spans' has {len(options.chunk_spans)} lists of ranges for "
                                    f"{len(request.inputs)} inputs; give one per input", param="chunk_spans")
            for i, item in enumerate(request.inputs):
                if not isinstance(item, str):
                    raise unprocessable(f"'chunk_spans[{i}]' gives character ranges, and '{request.param(i)}' is "
                                        "token ids: send the text, or fixed spans with 'chunk_size'",
                                        param=f"chunk_spans[{i}]")

    def _check_answer_size(self, request: EmbeddingRequest, vectors: int | None = None) -> None:
        """The answer of `vectors` vectors (one an input unless late chunking says how many)."""
        options, dimension = request.options, self.checks.dimension

        def answer_bytes(encoding_format: str) -> int:
            return max_answer_bytes(vectors or len(request.inputs), options.dimensions or dimension,
                                    options.output_dtype, encoding_format, self.checks.model_name, request.route)

        answer = answer_bytes(options.encoding_format)
        if answer <= self.checks.settings.max_response_bytes:  # the remedy below is worded for a refusal only
            return
        # base64 is no smaller for codes on the OpenAI route (4 bytes each): suggest it only where it helps.
        smaller = ", or \"encoding_format\": \"base64\"" if answer_bytes("base64") < answer else ""
        self.checks.answer_size(request, answer, f"send fewer inputs per request, fewer 'dimensions'{smaller}")

    def _prompt_of(self, request: EmbeddingRequest) -> Prompt:
        """The request's prompt: its prompt_name's; else, for Cohere's input_type, the model's prompt
        of that role where it has one; else the default."""
        name, role = request.options.prompt_name, request.options.input_type
        if name is None and role is not None:
            name = next((known for known in INPUT_TYPE_PROMPTS[role] if known in self.prompts), None)
        return self.prompt(name)

    def prompt(self, name: str | None) -> Prompt:
        if name is None:
            return self._prompt_tokens[self.default_prompt]
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none (the model defines no prompts)"
            raise unprocessable(f"unknown 'prompt_name' '{name}'; known: {known}", param="prompt_name")
        return self._prompt_tokens[self.prompts[name]]

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, Embeddings | RequestError]:
        """Each request's vectors as it asked: Matryoshka truncation first, then normalization, so
        truncated vectors are unit length, then its output dtype. This is also where a pipeline's
        final Normalize runs (the encoder leaves it out, model/head.py): `"normalize": false` keeps
        the vector before it. The rows of all requests that ask for one `dimensions` are
        normalized together, in one operation."""
        shaped: dict[int, torch.Tensor | np.ndarray | RequestError] = {}
        groups: dict[int | None, list[int]] = {}
        for index, job in jobs.items():
            vectors, _ = outcomes[index]
            if job.weights is not None:  # one vector per input from its windows' vectors
                vectors = pool_windows(vectors, job.windows, job.weights)
            dimensions = job.request.options.dimensions
            shaped[index] = vectors if dimensions is None else vectors[:, :dimensions]
            if job.normalize:
                groups.setdefault(dimensions, []).append(index)
        for indices in groups.values():
            parts = [shaped[index] for index in indices]
            try:
                normalized = l2_normalize(torch.cat(parts) if len(parts) > 1 else parts[0])
            except Exception as err:  # a bug met here fails these answers, not the batch
                log_failure("normalizing the embeddings of the batch", err)
                for index in indices:
                    shaped[index] = internal_error("the server failed to encode this answer; the failure is logged")
                continue
            # Each request's rows cut from the host array: a numpy slice costs less than a tensor
            # split and its numpy view.
            host, stop = normalized.numpy(), 0
            for index, part in zip(indices, parts):
                start, stop = stop, stop + part.shape[0]
                shaped[index] = host[start:stop]
        results: dict[int, Embeddings | RequestError] = {}
        for index, vectors in shaped.items():
            job = jobs[index]
            try:
                results[index] = vectors if isinstance(vectors, RequestError) else \
                    Embeddings(quantize(vectors.numpy() if isinstance(vectors, torch.Tensor) else vectors,
                                        job.request.options.output_dtype), job.tokens,
                               job.windows if job.weights is not None else None, job.spans)
            except Exception as err:  # a bug met by one answer must not fail its batch
                log_failure(f"quantizing the answer of request {index} of the batch", err)
                results[index] = internal_error("the server failed to encode this answer; the failure is logged")
        return results

    def tokens(self, request: EmbeddingRequest) -> list[list[dict[str, Any]]]:
        """TEI /tokenize: each text's tokens, the prompt in front, checked for size first."""
        if _modality(request) != "text":
            raise unprocessable("/tokenize tokenizes texts; \"modality\": \"image\" does not apply",
                                param="modality")
        self.check_limits(request)
        prompt = self.prompt(request.options.prompt_name).text
        texts = [prompt + text for text in request.inputs]
        return self.tokenizer.tokens(texts, request.options.add_special_tokens)
