"""A task is its slice: the service runs whatever slice the model's task has, through its
`prepare` and `results`, and the route's `parse` and `encode`, with no change of its own. Shown
with a trivial slice (each input's token count as a one-dimensional vector) put in the embed
slice's place."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.tasks.base import Job
from embedserve.handler.tasks.embed import Embeddings


class TokenCounts:
    """Answers each input's token count: no model output is read, only the Jobs' inputs."""
    task = Task.EMBED

    def __init__(self, text):
        self.text = text

    def prepare(self, requests, budget):
        return {index: Job(request, [ModelInput(ids) for ids in self.text.token_ids(list(request.inputs))])
                for index, request in requests.items()}

    def results(self, jobs, outcomes):
        return {index: Embeddings(torch.tensor([[len(item)] for item in job.inputs], dtype=torch.float32).numpy(),
                                  job.tokens) for index, job in jobs.items()}


def test_a_new_slice_is_served_without_touching_the_service(tiny_engine):
    service = replace(tiny_engine, work=TokenCounts(tiny_engine.text))
    texts = ["hello world", "a"]
    [native, tei] = service.handle([RawRequest(json.dumps({"input": texts}).encode(), "application/json", ""),
                                    RawRequest(json.dumps({"inputs": texts}).encode(), "application/json",
                                               Route.TEI_EMBED.value)])
    expected = [[float(len(ids))] for ids in tiny_engine.text.token_ids(texts)]
    assert [row["embedding"] for row in json.loads(native.body)["data"]] == expected
    assert json.loads(tei.body) == expected
