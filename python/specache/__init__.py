"""specache: SpeCache's agent and KV-memory client from Python.

- KvConfig, ModelShape, StepKind, Agent: the per-step agent API (C++ specache/agent.h) taking
  float32 tensors through DLPack (NumPy arrays, PyTorch CPU and CUDA tensors), used in place.
- InMemorySource, and with the service half built, Client / Session / DaemonSource /
  EmbeddedDaemon: where the full-precision KV lives (process memory or specached's pages).
- StatusError: every failure, with its StatusCode and message.
- specache.transformers (imported on demand): a Hugging Face Llama-family model with the agent
  holding its KV cache.
"""

from typing import Optional

from . import _core
from ._core import FullPrecisionSource, InMemorySource, KvConfig, ModelShape, StepKind, has_cuda, has_service
from ._status import StatusCode, StatusError

__version__ = _core.__version__

if has_service:
    from ._core import Client, DaemonSource, EmbeddedDaemon, Session


class Agent(_core.Agent):
    """The SpeCache agent. See _core.Agent for the methods.

    backend="cuda": tensors must be float32 on `device` (default: torch's current device), and the
    agent queues its kernels on `stream` (a cudaStream_t as int). When `stream` is None and
    PyTorch is loaded, the stream current in PyTorch when the agent is created is used, so the
    agent's work is ordered with the model's; set it explicitly to use another stream.

    When the agent goes (its last reference dropped), every sequence it still holds is released
    in `source`, as release_sequence does; the source itself stays. That waits for the device and,
    for a daemon's source, makes a call per sequence: other Python threads run meanwhile (the GIL
    is let go, as during the agent's other calls).
    """

    def __init__(
        self,
        shape: ModelShape,
        config: KvConfig,
        source: Optional[FullPrecisionSource] = None,
        backend: str = "cpu",
        device: Optional[int] = None,
        stream: Optional[int] = None,
        capacity_tokens: int = 32768,
        fetch_blocks: int = 32,
        device_pool_bytes: int = 0,
    ):
        if backend == "cuda" and (device is None or stream is None):
            torch = _loaded_torch()
            if device is None:
                device = torch.cuda.current_device() if torch is not None else 0
            if stream is None:
                stream = torch.cuda.current_stream(device).cuda_stream if torch is not None else 0
        super().__init__(
            shape,
            config,
            source,
            backend,
            -1 if device is None else device,
            0 if stream is None else stream,
            capacity_tokens,
            fetch_blocks,
            device_pool_bytes,
        )


def _loaded_torch():
    import sys

    return sys.modules.get("torch")


__all__ = [
    "Agent",
    "FullPrecisionSource",
    "InMemorySource",
    "KvConfig",
    "ModelShape",
    "StatusCode",
    "StatusError",
    "StepKind",
    "has_cuda",
    "has_service",
]
if has_service:
    __all__ += ["Client", "DaemonSource", "EmbeddedDaemon", "Session"]
