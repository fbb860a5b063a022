"""A transfer in flight as the state holds it (:class:`Job`): its pinned GPU blocks, its CPU
blocks, its sub-block pairs and whether its plan has run."""

from __future__ import annotations

from kvlog.reducers.blockset import IdArray

__all__ = ["Job"]


class Job:
    """One unfinished transfer: the physical GPU blocks it pins, the CPU blocks it uses,
    its ``(src, dst)`` sub-block pairs, and whether its plan has run (a deferred store's
    has not until ``TransferSubmitted`` or a flush)."""

    __slots__ = ("cpu_block_ids", "gpu_block_ids", "job_id", "kind", "pairs", "submitted", "term")

    def __init__(
        self,
        job_id: int,
        kind: str,
        gpu_block_ids: IdArray,
        cpu_block_ids: IdArray,
        pairs: tuple[IdArray, IdArray] | None = None,
        submitted: bool = True,
    ):
        self.job_id = job_id
        self.kind = kind
        self.gpu_block_ids = gpu_block_ids
        self.cpu_block_ids = cpu_block_ids
        self.pairs = pairs
        self.submitted = submitted
        self.term = -1
        """Its term of the running digest (``running.job_term``), once it is in a State."""
