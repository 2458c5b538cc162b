"""A page retriever's task (ColPali, ColQwen2; model/pages.py): the multi-vector task's requests and
answers, texts read as queries and images as pages.

- A text is a query: (ColPali: "<bos>") + the query prefix + the text + the query augmentation +
  "\\n", its every position's vector answered (the processor's process_queries' ids). `input_type`
  "document" is refused for texts: a page retriever's documents are page images.
- With "modality": "image", the inputs (a scoring request's documents) are page images, each a data
  URI (or an http(s) URL of an allowed host) read under the image limits, prepared by the folder's
  image processor; a page's ids are its image tokens (as many as its size gives, ColQwen2's; the
  same for every page, ColPali's) and the visual prompt, each position's vector answered.
- MaxSim scores a query against each page (the processor's score_retrieval's sum of maxima).
"""

from __future__ import annotations

from dataclasses import replace

from embedserve.handler.api.errors import unprocessable
from embedserve.handler.inputs.image import ImageReader, check_count, read_image
from embedserve.handler.model.description import MultiVector, Pages
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.pages import PageIds, image_tokens, query_text
from embedserve.handler.scheduling.admission import WorkBudget
from embedserve.handler.tasks.base import Job, RequestChecks
from embedserve.handler.tasks.multi_vector import MultiVectorRequest, MultiVectorTask


class PagesTask(MultiVectorTask):
    def __init__(self, checks: RequestChecks, model: MultiVector, pages: Pages, images: ImageReader,
                 page_ids: PageIds, bos: str, pad: str):
        """`page_ids`: a page image's ids by its image tokens; `bos`, `pad`: the tokenizer's tokens
        that the query template holds."""
        super().__init__(checks, model, {}, checks.max_length)
        self.pages = pages
        self.images = images
        self.page_ids = page_ids
        self.bos, self.pad = bos, pad

    def _job(self, request: MultiVectorRequest, budget: WorkBudget | None) -> Job:
        self.checks.count(request)
        options = request.options
        pages = [i for i in range(len(request.inputs))
                 if options.modality == "image" and not (request.scoring and i == 0)]
        if options.input_type == "document" and not pages:
            raise unprocessable("'input_type' document: a page retriever's documents are page images (send them "
                                "with \"modality\": \"image\"); its texts are queries", param="input_type")
        inputs: dict[int, ModelInput] = {}
        if pages:
            items = [(read_image(request.inputs[i], request.param(i)), request.param(i)) for i in pages]
            check_count([item for item, _ in items], request.field, self.images.limits)
            for i, prepared in zip(pages, self.images.model_inputs(items)):
                ids = self.page_ids(image_tokens(self.pages, prepared.grid))
                inputs[i] = replace(prepared, ids=ids, positions=len(ids))
        queries = [i for i in range(len(request.inputs)) if i not in inputs]
        for i in queries:
            self.checks.text.chars(request.inputs[i], request.param(i))
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        bodies = self.tokenizer.body_ids([query_text(self.pages, self.bos, self.pad, request.inputs[i])
                                          for i in queries])
        for i, ids in zip(queries, bodies):
            self.checks.text.length(request.param(i), len(ids), truncate)
            inputs[i] = ModelInput(ids[:self.checks.max_length])
        ordered = [inputs[i] for i in range(len(request.inputs))]
        tokens = sum(len(item) for item in ordered)
        if not request.scoring:  # the positions are known once the inputs are prepared (a page's are its ids')
            self._check_answer(request, tokens)
        self.checks.tokens(tokens, request.field, budget)
        return Job(request, ordered)
