"""Request preparation: every check a request meets before the model, its prompt, its token ids.

Each request is checked against the model and the limits on its own, so a bad one becomes its
own error and takes no part in the forward pass. The texts of all good requests are tokenized in
one call, then each request's lengths and tokens are checked on its own: too long an input is
truncated, or refused with truncation off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from embedserve.handler.api.codec import EmbeddingRequest, Route, max_answer_bytes
from embedserve.handler.api.errors import RequestError, internal_error, too_large, unprocessable
from embedserve.handler.api.quantize import SCALAR_DTYPES
from embedserve.handler.api.scoring import ScoringRequest, max_scoring_answer_bytes
from embedserve.handler.model.chat_pairs import ChatPairTokenizer, ChatTemplateError
from embedserve.handler.model.tokenization import TextTokenizer, Tokenized
from embedserve.handler.scheduling.admission import WorkBudget, max_request_tokens
from embedserve.handler.settings import Settings
from embedserve.handler.worker.failures import log_failure


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # its tokens without special tokens: what truncation never cuts
    unpooled: int  # what pooling leaves out: 0 unless the Pooling module excludes the prompt


@dataclass(frozen=True)
class Checked:
    """A valid embedding request before tokenizing: the texts it needs tokenized."""
    request: EmbeddingRequest
    normalize: bool
    prompt: Prompt
    texts: dict[int, str]  # input index -> prompt + text, for the tokenizer
    bodies: list[list[int] | None]  # token ids without special tokens; None where `texts` holds the input


@dataclass(frozen=True)
class Job:
    """A valid embedding or scoring request, tokenized: model input ids per input."""
    request: EmbeddingRequest | ScoringRequest
    ids: list[list[int]]
    normalize: bool
    unpooled: int = 0  # first tokens of each input that pooling leaves out (an excluded prompt)
    second: list[int] | None = None  # per input, where a pair's second text starts (token type 1)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.ids)


class RequestPreparer:
    def __init__(self, tokenizer: TextTokenizer, settings: Settings, *, model_name: str, dimension: int,
                 max_length: int, prompts: dict[str, str], default_prompt: str, include_prompt: bool,
                 chat_pairs: ChatPairTokenizer | None = None):
        """`include_prompt`: whether pooling counts the prompt's tokens (the Pooling module's own flag);
        `chat_pairs`: a causal reranker's pairs rendering, its instruction the prompt."""
        self.tokenizer = tokenizer
        self.chat_pairs = chat_pairs
        self.settings = settings
        self.model_name = model_name
        self.dimension = dimension
        self.max_length = max_length
        self.prompts = prompts
        self.default_prompt = default_prompt
        self._include_prompt = include_prompt
        self._prompt_tokens = {text: self._measure_prompt(text) for text in {default_prompt, *prompts.values()}}

    def _measure_prompt(self, text: str) -> Prompt:
        if not text:
            return Prompt("", 0, 0)
        return Prompt(text, tokens=len(self.tokenizer.body_ids([text])[0]),
                      unpooled=0 if self._include_prompt else self.tokenizer.prompt_length(text))

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Model input ids with the server's defaults (right truncation at max_length, no prompt)."""
        return [self.tokenizer.assemble(body, self.max_length, "right").ids for body in self.tokenizer.body_ids(texts)]

    def check(self, request: EmbeddingRequest) -> Checked:
        """Every check before tokenizing: limits, options, prompt, token ids; and the texts to
        tokenize: `prompt + text`, tokenized as one string, as sentence-transformers does. With a
        prompt, token-id inputs are the text they decode to, so that both forms of one text give
        the same vector."""
        options = request.options
        normalize = self.settings.normalize if options.normalize is None else options.normalize
        self._check_limits(request)
        self._check_options(request, normalize)
        prompt = self._prompt(options.prompt_name)
        texts: dict[int, str] = {}
        bodies: list[list[int] | None] = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                texts[i] = prompt.text + item
                bodies.append(None)
                continue
            for j, token in enumerate(item):
                if token >= self.tokenizer.vocab_size:
                    raise unprocessable(f"'{request.field}[{i}][{j}]' is token id {token}, outside the "
                                        f"vocabulary of {self.tokenizer.vocab_size}",
                                        param=f"{request.field}[{i}][{j}]")
            if prompt.text:
                texts[i] = prompt.text + self.tokenizer.decode(item)
            bodies.append(None if prompt.text else list(item))
        return Checked(request, normalize, prompt, texts, bodies)

    def tokenize(self, checked: dict[int, Checked], budget: WorkBudget | None) -> dict[int, Job | RequestError]:
        """The checked requests' texts tokenized in one call, then each request finished on its
        own: a request over a token limit gets its error, the others go on."""
        texts = [text for pending in checked.values() for text in pending.texts.values()]
        try:
            tokenized = self.tokenizer.body_ids(texts) if texts else []
        except Exception:  # a text that breaks the tokenizer: tokenize each request alone to find its owner
            tokenized = None
        outcomes: dict[int, Job | RequestError] = {}
        start = 0
        for index, pending in checked.items():
            stop = start + len(pending.texts)
            try:
                own = tokenized[start:stop] if tokenized is not None else \
                    self.tokenizer.body_ids(list(pending.texts.values()))
                outcomes[index] = self._finish(pending, own, budget)
            except RequestError as err:
                outcomes[index] = err
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                outcomes[index] = internal_error()
            start = stop
        return outcomes

    def _finish(self, checked: Checked, tokenized: list[list[int]], budget: WorkBudget | None) -> Job:
        """The checks after tokenizing, given the token ids of `checked.texts` in order: length
        per input (truncated, or refused with truncation off) and tokens per request."""
        request, prompt = checked.request, checked.prompt
        options = request.options
        bodies = list(checked.bodies)
        for i, ids in zip(checked.texts, tokenized):
            bodies[i] = ids
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        assembled = [self.tokenizer.assemble(body, self.max_length, options.truncation_direction, keep=prompt.tokens)
                     for body in bodies]
        for i, item in enumerate(assembled):
            if not truncate and item.full_length > self.max_length:
                raise too_large(
                    f"'{request.param(i)}' has {item.full_length} tokens; the limit is {self.max_length} "
                    "and truncation is off (send \"truncate\": true to cut it)",
                    param=request.param(i))
        self._check_tokens(sum(len(item.ids) for item in assembled), request.field, budget)
        return Job(request, [item.ids for item in assembled], checked.normalize, prompt.unpooled)

    def _check_tokens(self, total: int, field: str, budget: WorkBudget | None) -> None:
        if total > self.settings.max_tokens_per_request:
            raise too_large(f"the request has {total} tokens; the limit is max_tokens_per_request="
                            f"{self.settings.max_tokens_per_request}", param=field)
        limit = max_request_tokens(self.settings.max_tokens_per_request, budget)
        if total > limit:  # only under a work budget
            raise too_large(f"the request has {total} tokens; this worker embeds about "
                            f"{budget.tokens_per_second:.0f} tokens/s, so a request may hold at most "
                            f"{limit} tokens to finish well within the server's "
                            f"{budget.response_timeout_s:.0f} s response timeout; send fewer or shorter inputs per "
                            "request", param=field)

    def prepare_scoring(self, request: ScoringRequest, budget: WorkBudget | None) -> Job:
        """A reranker's or classifier's request, checked and tokenized: each (query, document)
        pair, or text, as one model input, truncated as sentence-transformers' CrossEncoder
        truncates it; the same limits as embeddings, documents counting as inputs."""
        settings = self.settings
        self._check_count(request)
        predict = request.route is Route.TEI_PREDICT
        for i, (first, second) in enumerate(request.inputs):
            names = ((f"inputs[{i}][0]", f"inputs[{i}][1]") if second is not None else (f"inputs[{i}]", None)) \
                if predict else ("query", request.param(i))
            for text, param in zip((first, second), names):
                if text is not None and len(text) > settings.max_input_chars:
                    raise too_large(f"'{param}' has {len(text)} characters; the limit is "
                                    f"max_input_chars={settings.max_input_chars}", param=param)
        answer = max_scoring_answer_bytes(request, self.dimension)
        if answer > settings.max_response_bytes:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs, whose answer could take {answer} "
                            f"bytes; the server sends at most max_response_bytes={settings.max_response_bytes} per "
                            "answer: send fewer inputs per request, or do not ask for the texts back",
                            param=request.field)
        tokenized = self._pairs(request)
        truncate = settings.truncate if request.truncate is None else request.truncate
        for i, item in enumerate(tokenized):
            if not truncate and item.full_length > self.max_length:
                with_query = "" if predict else " with its query"
                raise too_large(f"'{request.param(i)}' has {item.full_length} tokens{with_query}; the limit is "
                                f"{self.max_length} and truncation is off (send \"truncate\": true to cut it)",
                                param=request.param(i))
        self._check_tokens(sum(len(item.ids) for item in tokenized), request.field, budget)
        seconds = [item.second for item in tokenized]
        return Job(request, [item.ids for item in tokenized], normalize=False,
                   second=seconds if any(seconds) else None)

    def _pairs(self, request: ScoringRequest) -> list[Tokenized]:
        """Each input tokenized as the model reads it: through a causal reranker's chat template,
        with the request's instruction or the model's default one, or as a tokenizer pair."""
        if self.chat_pairs is None:
            if request.instruction is not None:
                raise unprocessable("'instruction' is for causal language model rerankers, which render it through "
                                    "their chat template; this model takes none", param="instruction")
            return self.tokenizer.pairs(request.inputs, self.max_length, request.truncation_direction)
        for i, (_, second) in enumerate(request.inputs):
            if second is None:
                raise unprocessable(f"'{request.param(i)}' is a single text; this reranker scores (query, document) "
                                    "pairs through its chat template: send [query, document]", param=request.param(i))
        instruction = self.default_prompt if request.instruction is None else request.instruction
        if len(instruction) > self.settings.max_input_chars:
            raise too_large(f"'instruction' has {len(instruction)} characters; the limit is "
                            f"max_input_chars={self.settings.max_input_chars}", param="instruction")
        try:
            return self.chat_pairs.pairs(request.inputs, self.max_length, request.truncation_direction, instruction)
        except ChatTemplateError as err:
            raise unprocessable(f"the model's chat template refused this request: {str(err)[:300]}",
                                param=request.field) from None

    def tokens(self, request: EmbeddingRequest) -> list[list[dict[str, Any]]]:
        """TEI /tokenize: each text's tokens, the prompt in front, checked for size first."""
        self._check_limits(request)
        prompt = self._prompt(request.options.prompt_name).text
        texts = [prompt + text for text in request.inputs]
        return self.tokenizer.tokens(texts, request.options.add_special_tokens)

    def _check_limits(self, request: EmbeddingRequest) -> None:
        """Input count and characters per text, both before any tokenizing."""
        self._check_count(request)
        limit = self.settings.max_input_chars
        for i, item in enumerate(request.inputs):
            if isinstance(item, str) and len(item) > limit:
                raise too_large(f"'{request.param(i)}' has {len(item)} characters; the limit is "
                                f"max_input_chars={limit}", param=request.param(i))

    def _check_count(self, request: EmbeddingRequest | ScoringRequest) -> None:
        if len(request.inputs) > self.settings.max_inputs_per_request:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs; the limit is "
                            f"max_inputs_per_request={self.settings.max_inputs_per_request}", param=request.field)

    def _check_options(self, request: EmbeddingRequest, normalize: bool) -> None:
        options = request.options
        if options.dimensions is not None and options.dimensions > self.dimension:
            raise unprocessable(f"'dimensions' must be at most the model's dimension {self.dimension}, "
                                f"got {options.dimensions}", param="dimensions")
        def answer_bytes(encoding_format: str) -> int:
            return max_answer_bytes(len(request.inputs), options.dimensions or self.dimension,
                                    options.output_dtype, encoding_format, self.model_name, request.route)

        answer = answer_bytes(options.encoding_format)
        if answer > self.settings.max_response_bytes:
            # base64 is no smaller for codes on the OpenAI route (4 bytes each): suggest it only where it helps.
            smaller = ", or \"encoding_format\": \"base64\"" if answer_bytes("base64") < answer else ""
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs, whose answer could take {answer} "
                            f"bytes; the server sends at most max_response_bytes={self.settings.max_response_bytes} "
                            "per answer (the archive's, or TorchServe's max_response_size where lower): send fewer "
                            f"inputs per request, fewer 'dimensions'{smaller}",
                            param=request.field)
        # Only the answer's own normalization makes unit vectors: the pipeline's final Normalize
        # is left to it (model/head.py), so `normalize: false` gives vectors of any length.
        if options.output_dtype in SCALAR_DTYPES and not normalize:
            raise unprocessable(f"'output_dtype' {options.output_dtype} quantizes the range [-1, 1] of "
                                "normalized vectors; with \"normalize\": false they are not unit length: drop "
                                "\"normalize\": false or use float/binary", param="output_dtype")

    def _prompt(self, name: str | None) -> Prompt:
        if name is None:
            return self._prompt_tokens[self.default_prompt]
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none (the model defines no prompts)"
            raise unprocessable(f"unknown 'prompt_name' '{name}'; known: {known}", param="prompt_name")
        return self._prompt_tokens[self.prompts[name]]
