"""Host arrays to the device without stalling the host.

On a GPU the host can prepare the next pass while the device runs this one only if no copy
waits for the device. A copy from pageable memory does: CUDA stages it through a pinned buffer
and returns once the stream has taken it. So a pass's inputs go through pinned memory (torch's
caching host allocator reuses the buffers and keeps each until its copy has run), and the
encoder gathers a batch's vectors on the device and reads them back once: one synchronization
per batch, not one per pass. On a CPU the arrays are used as they are, without a copy.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
