"""Host <-> GPU copies that do not wait for the GPU.

A copy from pageable host memory to the GPU synchronizes the stream: the host waits until every kernel
queued before it has run (the H200's served profile found the block table's per-page writes there).
With the engine scheduling a step while the GPU still runs the one before (``EngineCore``'s async
scheduling), such a wait would stall the host for a whole step. ``upload`` goes through pinned memory
with a non-blocking copy; ``Readback`` brings a device tensor back the same way and waits, when asked,
for that copy alone, not for the work queued after it.
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``, stream-ordered, without waiting for the GPU (on the CPU: ``host.to``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A list of numbers as a tensor on ``device`` (``upload``: no stream sync)."""
    return upload(torch.tensor(values, dtype=dtype), device)


class Readback:
    """A device tensor's copy to the host, started now (pinned memory, non-blocking); ``tolist`` waits for
    the copy only -- steps queued on the stream after it keep running."""

    def __init__(self, x: torch.Tensor):
        self._event = None
        if x.is_cuda:
            self._host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self._host.copy_(x, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(x.device))
        else:
            self._host = x.clone()

    def tensor(self) -> torch.Tensor:
        """The host copy, once it is complete."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def tolist(self) -> list:
        return self.tensor().tolist()
