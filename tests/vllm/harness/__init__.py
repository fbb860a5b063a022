"""kvlog inside vLLM 0.33's real v1 scheduler and offloading connector, with canary bytes
(the package behind ``tests/vllm_harness.py``; its docstring says what runs and what is
checked). One file a concern:

- ``configs``: :class:`RunConfig`, the CI matrix and its families, random configurations;
- ``workload``: requests and the canary bytes of every token position;
- ``chunks``: vLLM's chunk mapping (GPU blocks to CPU sub-blocks), restated;
- ``kvcache``: the KV tensors (Gaudi layout), CPU readers, the reference worker;
- ``vllm_objects``: vLLM's scheduler and connector config for a run, kvlog's defragmenter
  (the vLLM stubs themselves are ``kvlog.synth.vllm_stubs``, shared with ``--scheduler vllm``);
- ``results``: :class:`RunResult` and the matrix table;
- ``checks``: the checks (a)-(d) of a run; ``run``: one configuration end to end;
- ``shadow``: vLLM's plain connector worker, timed beside kvlog's on the same calls.
"""

from __future__ import annotations

from tests.vllm.harness.checks import Checks
from tests.vllm.harness.chunks import vllm_chunk_mapping
from tests.vllm.harness.configs import (
    CANARY_SALTS,
    CI_MATRIX,
    CONFIGS,
    DEFRAG_MOST_STEPS,
    DEFRAG_ONLY,
    GAUDI_RUNNER,
    GAUDI_RUNNER_CI,
    KVLOG_CONNECTOR,
    MAX_DETAILS,
    REFERENCE_CLEAN,
    REFERENCE_UNAWARE,
    RunConfig,
    random_configs,
    without_switch,
)
from tests.vllm.harness.kvcache import CpuReader, KvCache, ReferenceWorker
from tests.vllm.harness.results import COLUMNS, MAIN_CONFIGS, RunResult, cost_summary, format_table
from tests.vllm.harness.run import Run, run_config
from tests.vllm.harness.shadow import PlainShadow
from tests.vllm.harness.vllm_objects import (
    build_vllm,
    make_defragmenter,
    make_request,
    page_bytes_per_block,
)
from tests.vllm.harness.workload import Sequence_, canary, make_sequence, make_workload

__all__ = [
    "CANARY_SALTS",
    "CI_MATRIX",
    "COLUMNS",
    "CONFIGS",
    "DEFRAG_MOST_STEPS",
    "DEFRAG_ONLY",
    "GAUDI_RUNNER",
    "GAUDI_RUNNER_CI",
    "KVLOG_CONNECTOR",
    "MAIN_CONFIGS",
    "MAX_DETAILS",
    "PlainShadow",
    "REFERENCE_CLEAN",
    "REFERENCE_UNAWARE",
    "Checks",
    "CpuReader",
    "KvCache",
    "ReferenceWorker",
    "Run",
    "RunConfig",
    "RunResult",
    "Sequence_",
    "build_vllm",
    "canary",
    "cost_summary",
    "format_table",
    "make_defragmenter",
    "make_request",
    "make_sequence",
    "make_workload",
    "page_bytes_per_block",
    "random_configs",
    "run_config",
    "vllm_chunk_mapping",
    "without_switch",
]
