"""Encoders built from parts for the tests: the same model and prices as an engine's encoder,
on another backend (one that replays stand-in graphs, or injects faults), instead of
reassigning an encoder's internals."""

from __future__ import annotations

from dataclasses import replace

import torch

from embedserve.handler.backends.base import Backend
from embedserve.handler.execution.encoder import Encoder
from embedserve.handler.execution.select import ModelParts
from tests.support.faults import FaultInjectingBackend, FaultInjection


def on_backend(encoder: Encoder, backend: Backend, *, placement=None, lending=None, **cost) -> Encoder:
    """An encoder like `encoder` that runs `backend`; `placement`, `lending` and `cost` (pass
    prices) replace its own where given."""
    return encoder.with_backend(backend, placement=placement, lending=lending, cost=replace(encoder.cost, **cost))


def replaying(encoder: Encoder, graphs, **cost) -> Encoder:
    """`encoder` whose backend replays `graphs` (captured on its eager pass)."""
    return on_backend(encoder, encoder.backend.with_graphs(graphs), **cost)


def parts_of(engine) -> ModelParts:
    """What the selection was given for `engine`'s model, but its head, which the graph step does
    not read (it captures the backend's whole pass)."""
    return ModelParts(pooling=engine.encoder.pooling, head=(), pad_id=engine.encoder.pad_id,
                      max_batch_size=engine.settings.max_batch_size, max_positions=engine.encoder.max_positions,
                      max_length=engine.text.max_length)


def torch_model(encoder: Encoder) -> torch.nn.Module:
    """The torch model behind a padded or packed torch backend."""
    transformer = encoder.backend.transformer
    return transformer.model


class ObservedBackend:
    """A backend whose passes are first shown to `observe(inputs)` (which may raise, as a failing
    pass does), and whose output `alter(inputs, output)` may change; the rest is `backend`'s."""

    def __init__(self, backend: Backend, observe=None, alter=None):
        self.backend, self.observe, self.alter = backend, observe, alter
        self.device = backend.device

    def plan(self, lengths, cost):
        return self.backend.plan(lengths, cost)

    def prepare(self, rows):
        return self.backend.prepare(rows)

    def run(self, inputs, *, eager=False):
        if self.observe is not None:
            self.observe(inputs)
        output = self.backend.run(inputs, eager=eager)
        return output if self.alter is None else self.alter(inputs, output)

    def computed_tokens(self, inputs):
        return self.backend.computed_tokens(inputs)

    def describe(self):
        return self.backend.describe()

    @property
    def thread_counts(self):
        return self.backend.thread_counts


def with_faults(service, faults: FaultInjection):
    """`service`'s twin whose passes first meet `faults` (as tests/support/fault_entry.py makes a worker's)."""
    return backed_by(service, FaultInjectingBackend(service.encoder.backend, faults))


def backed_by(service, backend: Backend):
    """`service`'s twin, its encoder on `backend`."""
    return replace(service, encoder=service.encoder.with_backend(backend))


def poisoned(service, token: int, nan: bool = False):
    """`service`'s twin whose passes holding `token` raise, or give NaN rows: a failure only
    some inputs cause."""

    def observe(inputs):
        if not nan and bool((inputs.ids == token).any()):
            raise RuntimeError("a forward failure only some inputs cause")

    def alter(inputs, output):
        if not nan:
            return output
        rows = (inputs.ids == token).any(dim=1)  # padded passes: one row an input
        return torch.where(rows.unsqueeze(1), torch.full_like(output, float("nan")), output)

    return backed_by(service, ObservedBackend(service.encoder.backend, observe=observe, alter=alter))
