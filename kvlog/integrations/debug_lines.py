"""The Gaudi plugin's defragmenter log lines, word for word.

Under ``VLLM_DEBUG=defrag`` (a comma-separated list, as vllm-gaudi reads it) the plugin's
``OnlineDefragmenter`` writes, through its debug logger (``[area] message`` at WARNING)::

    [defrag] initialized
    [defrag] updating state: 12 new_blocks 3 finished reqs
    [defrag] defragmentation done max_id_used=95->61 num_used=58 swapped=34/64

and, always, around its warm-up (INFO)::

    Warming up defragmenter with thresholds: [8, 16, 32, 64, 128, 256, 512]
    Defragmenter warmup completed successfully

kvlog's defragmenter writes the same lines with the same figures, so an operator's log
searches and alerts keep working (:class:`DefragLines`). They go to vllm-gaudi's logger
where it is importable, else to ``vllm``'s. (kvlog's own lines, a detached recorder or a log
that cannot be opened, go to the ``kvlog`` logger, once each: they are one-time events.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

__all__ = ["DefragLines", "debug_areas", "plugin_logger"]


def debug_areas(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The areas ``VLLM_DEBUG`` turns on (vllm-gaudi's comma-separated list)."""
    text = (os.environ if environ is None else environ).get("VLLM_DEBUG", "")
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def plugin_logger() -> logging.Logger:
    """The logger the plugin's lines go to: vllm-gaudi's where importable, else vLLM's."""
    try:
        from vllm_gaudi.extension.logger import logger  # type: ignore[import-not-found]

        found = logger()
        if isinstance(found, logging.Logger):
            return found
    except Exception:  # no vllm-gaudi here: vLLM's logger carries the same text
        pass
    return logging.getLogger("vllm")


class DefragLines:
    """The plugin's defragmenter lines (module docstring); ``debug`` is False unless
    ``VLLM_DEBUG`` names ``defrag``: then every call below is one attribute test."""

    __slots__ = ("debug", "logger")

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.debug = "defrag" in debug_areas(environ)
        self.logger = plugin_logger()

    def say(self, message: str) -> None:
        self.logger.warning(f"[defrag] {message}")

    def initialized(self) -> None:
        if self.debug:
            self.say("initialized")

    def updating_state(self, num_new_blocks: int, num_finished: int) -> None:
        if self.debug and (num_new_blocks > 0 or num_finished > 0):
            self.say(f"updating state: {num_new_blocks} new_blocks {num_finished} finished reqs")

    def done(self, pre_max_used: int, max_used: int, num_used: int, swapped: int, pad: int) -> None:
        if self.debug:
            post_status = (
                f"max_id_used={pre_max_used}->{max_used} num_used={num_used} "
                f"swapped={swapped}/{pad}"
            )
            self.say(f"defragmentation done {post_status}")

    def warming_up(self, thresholds: Sequence[int]) -> None:
        self.logger.info("Warming up defragmenter with thresholds: %s", list(thresholds))

    def warmed_up(self) -> None:
        self.logger.info("Defragmenter warmup completed successfully")

    def warmup_skipped(self, num_blocks: int) -> None:
        self.logger.warning("Skipping defragmenter warmup, insufficient blocks (%s)", num_blocks)
