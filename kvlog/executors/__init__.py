"""Plans applied to torch tensors: cache layouts, swaps, transfers, device backends.

    executor = make_executor(kv_caches, config, backend="cpu", layout="auto", seed=0)
    executor.execute(plan)            # SwapPlan now; TransferPlan queued on a stream
    results = executor.poll()         # finished TransferCompletions, in submit order
    executor.wait(); executor.shutdown()

See ``layouts`` for the accepted KV-cache layouts, ``devices`` and ``fake`` for the
backends, ``swap`` and ``transfer`` for how plans become copies.
"""

from kvlog.executors.devices import BACKENDS, CpuDevice, Device, InjectedFailure, StreamDevice
from kvlog.executors.executor import Executor, make_executor
from kvlog.executors.fake import FakeDevice
from kvlog.executors.layouts import LAYOUTS, CacheLayout, CanonicalTensor, register_layout
from kvlog.executors.transfer import TransferCompletion

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "CacheLayout",
    "CanonicalTensor",
    "CpuDevice",
    "Device",
    "Executor",
    "FakeDevice",
    "InjectedFailure",
    "StreamDevice",
    "TransferCompletion",
    "make_executor",
    "register_layout",
]
