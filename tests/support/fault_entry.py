"""The TorchServe entry of a worker that injects the faults EMBEDSERVE_TEST_FAULTS names
(tests/support/faults.py): the real entry, its encoder's backend wrapped once warm-up has
measured it. Fault tests and bench.overlap build archives that start their workers here
(tests/support/serving.py, with_fault_entry); the production entry knows nothing of faults.

TorchServe takes the one class this module defines as the handler.
"""

from __future__ import annotations

from embedserve.handler.torchserve.entry import EmbeddingHandler
from tests.support.faults import FaultInjectingBackend, FaultInjection


class FaultInjectingHandler(EmbeddingHandler):
    def initialize(self, context) -> None:
        super().initialize(context)
        faults = FaultInjection.from_env()  # the workers inherit the variable from the frontend
        if faults is not None:
            encoder = self.service.encoder
            encoder.backend = FaultInjectingBackend(encoder.backend, faults)
