"""EventOverlap and completion events, as DeepEP V1's deep_ep.utils exposes them; free_port for loopback groups."""
import socket
from typing import Any, Optional, Tuple


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: the rendezvous of a loopback process group (llep.engine's launcher, the
    tests and benchmarks), or an exporter's port."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class CompletedEvent:
    """An event that is already complete: what CPU-backend operations return where DeepEP returns a CUDA event
    (everything they launch has finished when the call returns)."""

    def current_stream_wait(self) -> None:
        return None


class EventOverlap:
    """A wrapper of an event plus tensors to keep alive until it completes (DeepEP V1 semantics).

    Attributes:
        event: the event (a CUDA event handle, or CompletedEvent on the CPU backend), or None.
        extra_tensors: tensors kept alive with the event, instead of record_stream (CUDA-graph friendly).
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event. The event must exist."""
        assert self.event is not None, 'EventOverlap.current_stream_wait() needs an event (async_finish=True)'
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
