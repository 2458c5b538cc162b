"""`ArchiveEmbedder`: the callable class for `ray.data.Dataset.map_batches`.

Each actor assembles the service from the archive with the composition root a TorchServe worker
uses (embedserve/handler/assembly.py): the same engine trial and dtype, the same limits, the same
vectors. A batch's texts go to it as requests to its OpenAI route, grouped within its limits and
embedded one group after another, exactly as `embedserve batch` sends them over HTTP (grouping.py,
embedding.py), so a text the service refuses fails alone, with its reason in the `error` column.

The actor's threads are the CPUs Ray assigned it (`num_cpus`), not the node's: several actors
share a node without oversubscribing it (`cpu_threads` sets them, e.g. outside Ray). With a GPU assigned (`num_gpus=1`) it runs there. A device
failure ends the actor's process, as it ends a TorchServe worker's: Ray starts another (Ray Data
restarts pool actors and retries their tasks), so the batch is redone, not lost."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import orjson

from embedserve.batch.client import Answer
from embedserve.batch.embedding import group_outcomes
from embedserve.batch.grouping import Budget, groups
from embedserve.batch.inputs import Row
from embedserve.batch.outputs import vector_column
from embedserve.batch.server import Limits
from embedserve.handler.api.exchange import JSON, RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.execution.device_errors import DeviceFailure
from embedserve.ray_data.archive import open_archive

log = logging.getLogger(__name__)

ROUTE = "v1/embeddings"
DEVICE_FAILURE_EXIT = 3  # the exit status a TorchServe worker leaves with after a device failure


class ArchiveEmbedder:
    """Adds `embedding` (fixed_size_list<float32>[dimension], null where a text failed) and `error`
    to each batch (a pyarrow Table); every other column passes through, the text column too
    unless `drop_text`."""

    def __init__(self, archive: str, *, text_column: str = "text", options: dict[str, Any] | None = None,
                 drop_text: bool = True, cpu_threads: int | None = None):
        import torch

        if not logging.getLogger().handlers:  # the actor's own process: its log is the worker's log file
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        opened = open_archive(archive)
        gpu_id = 0 if torch.cuda.is_available() and _assigned("GPU") else None  # Ray sets CUDA_VISIBLE_DEVICES
        # A CPU actor's threads: the CPUs Ray assigned it (outside Ray: `cpu_threads`, else one).
        threads = cpu_threads or max(1, int(_assigned("CPU") or 1))
        settings = opened.settings if gpu_id is not None else replace(opened.settings, cpu_threads=threads)
        self.service = assemble(opened.model_dir, settings, model_name=opened.model_name, gpu_id=gpu_id,
                                response_timeout_s=opened.response_timeout_s, model_version=opened.version)
        info = self.service.info()
        if info.get("task") != "embed":
            raise ValueError(f"the archive's model is a {info.get('task')} model; the Ray Data path embeds texts "
                             "with an embedding model")
        self.text_column, self.drop_text = text_column, drop_text
        self.options = dict(options or {})
        self.model = opened.model_name
        self.values = self._probe()
        self.budget = Budget.of(Limits.from_info(info), concurrency=1, dimensions=self.values, model=self.model)
        log.info("embedder ready on node %s: %s on %s, %s, %d threads, %d values a vector", _node_id(), self.model,
                 info["device"], info["model_dtype"], self.service.encoder.placement.cpu_threads, self.values)

    def _probe(self) -> int:
        """The vectors' length under `options`; options the service refuses stop the job here, with its message."""
        answer = self._post(orjson.dumps({**self.options, "model": self.model, "input": ["probe"]}))
        if answer.status != 200:
            raise ValueError(f"the service refuses these options ({self.options}): {answer.body.decode()}")
        return len(orjson.loads(answer.body)["data"][0]["embedding"])

    def _post(self, body: bytes) -> Answer:
        try:
            [response] = self.service.handle([RawRequest(body, JSON, ROUTE, "POST")])
        except DeviceFailure as err:
            log.critical("device failure (%s); this actor exits and Ray starts another", err)
            os._exit(DEVICE_FAILURE_EXIT)
        return Answer(response.status, response.body, "")

    def __call__(self, batch):
        import pyarrow as pa

        rows = (Row(id=i, text=text) for i, text in enumerate(text_cells(batch, self.text_column)))
        outcomes = [outcome for group in groups(rows, self.budget)
                    for outcome in group_outcomes(self._post, group, self.options, self.model, self.values)]
        vectors = [vector for vector, _, _ in outcomes]
        errors = [error for _, error, _ in outcomes]
        kept = batch.drop_columns([self.text_column]) if self.drop_text else batch
        return kept.append_column("embedding", vector_column(vectors, self.values)) \
                   .append_column("error", pa.array(errors, pa.string()))


def text_cells(table, column: str) -> list[str | None]:
    """The texts of `column`, which must hold strings (a null cell is a row's own error)."""
    import pyarrow as pa

    if column not in table.column_names:
        raise KeyError(f"no column {column!r}; the table has {table.column_names}: name the texts' column")
    cells = table.column(column)
    if not (pa.types.is_string(cells.type) or pa.types.is_large_string(cells.type) or pa.types.is_null(cells.type)):
        raise TypeError(f"column {column!r} holds {cells.type}, not strings")
    return cells.to_pylist()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "-"


def _assigned(resource: str) -> float:
    """How much of `resource` Ray assigned this actor (0 outside Ray)."""
    import ray

    if not ray.is_initialized():
        return 0.0
    return float(ray.get_runtime_context().get_assigned_resources().get(resource, 0.0))
