"""LoCo's side stream: compression and the hierarchical stage 2 off the compute stream.

docs/kernels.md ("Streams"). A stock asynchronous reduce-scatter costs the compute stream
nothing at launch: NCCL's own stream waits for the gradient and runs the collective, and the
compute stream waits only in ``finish_grad_sync``. LoCo's compress is a kernel, not a
collective; on the compute stream it would run in line with the backward GEMMs. So with
``async_op`` every LoCo launch (:func:`launch_stream`) orders one side stream per device after
the stream that produced the gradient (an event recorded there, waited on by the side stream)
and issues its compress, its full-precision lane and its all-to-alls from the side stream:
NCCL's stream then waits for the side stream, not for the compute stream's later work. The
compute stream waits only where it reads a result (``LoCoWork.wait``: the all-to-alls; the
hierarchical ``final``: the inter-node stage), which covers the side stream's work before them.
Synchronous launches (overlap off) stay on the current stream, as stock.

Tensor lifetimes across streams, without ``record_stream``. The caching allocator reuses a
freed block on the stream it was allocated on, so each buffer is kept alive until every other
stream that touches it is ordered before that stream's next use:

* receive buffers the compute stream reads (the flat all-to-alls' outputs) are allocated on the
  compute stream before the switch (:func:`launch_stream` allocates nothing);
* send buffers and codes (allocated on the side stream by compress) are held by their handle
  until its ``finish``, which runs after the compute stream waited for the collectives; a later
  launch's side-stream allocation is then ordered after that wait (every launch starts with the
  side stream waiting on the current stream), so NCCL is done with them first;
* the error buffers are persistent; the compute stream touches them (checkpoints, loss-scale
  rescaling) only after ``finish_grad_sync``, and the next compress is ordered after it.

The CPU emulation of CUDA models streams, events, NCCL's per-group streams and waits
(:mod:`loco_megatron.emulation.stream_log`); tests/distributed/test_stream_order.py checks this
ordering there. Plain CPU tensors (gloo without the emulation) use no streams.
"""

import contextlib
from typing import Dict

import torch

#: device index -> (side stream, the event its launches wait on); emptied by :func:`forget`
_SIDE: Dict[object, tuple] = {}


def _side(device: torch.device) -> tuple:
    entry = _SIDE.get(device.index)
    if entry is None:
        entry = _SIDE[device.index] = (torch.cuda.Stream(device=device), torch.cuda.Event())
    return entry


def side_stream(device: torch.device):
    """LoCo's side stream on ``device`` (created on first use, default priority)."""
    return _side(device)[0]


@contextlib.contextmanager
def launch_stream(tensor: torch.Tensor, enabled: bool = True):
    """Run the body on LoCo's side stream, ordered after the current stream's work so far.

    Args:
        tensor: a tensor of the launch (its device picks the side stream). A tensor that is not
            on a CUDA device (``is_cuda`` False; the CPU emulation reports True) runs the body
            on the current stream.
        enabled: False runs the body on the current stream (synchronous launches).

    Yields the side stream, or None when the body runs on the current stream. Nested on the
    side stream itself, it adds no wait.
    """
    if not (enabled and tensor.is_cuda):
        yield None
        return
    current = torch.cuda.current_stream()
    side, event = _side(tensor.device)
    if current == side:
        yield side
        return
    event.record(current)  # the gradient producer's work so far
    side.wait_event(event)
    with torch.cuda.stream(side):
        yield side


def forget() -> None:
    """Drop the side streams (``uninstall()``; a later launch creates new ones)."""
    _SIDE.clear()
