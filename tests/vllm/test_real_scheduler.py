"""kvlog under vLLM 0.33's real scheduler and offloading connector (see ``vllm_harness.py``).

Runs only where vLLM is installed (the vLLM stage of ``.ci/run``, in its own virtualenv); the
main test run skips this module. Each configuration drives at least 150 requests through
vLLM's ``Scheduler`` with chunked prefill, preemptions and CPU offload, calls kvlog the way
vllm-gaudi's runner does, and checks canary bytes, tables, completions and the log's replay.
``test_matrix_table`` prints the figures of all runs (``-s`` not needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    minversion="0.33",
    reason="vLLM 0.33 is not installed here: the vLLM stage runs this module in its own venv",
)

from tests import vllm_harness as harness

RESULTS: list[harness.RunResult] = []


@pytest.mark.parametrize("cfg", harness.CI_MATRIX, ids=lambda c: c.name)
def test_kvlog_in_real_vllm(cfg: harness.RunConfig, tmp_path: Path) -> None:
    res = harness.run_config(cfg, str(tmp_path))
    RESULTS.append(res)
    assert res.ok, res.summary()
    # the run exercised what it is meant to
    assert res.requests >= 150
    assert res.preemptions >= 30, f"only {res.preemptions} preemptions"
    assert res.stores_done > 0 and res.loads_done > 0
    assert (res.loads_sync > 0) == cfg.sync_loads
    assert res.replay_ok is True
    if cfg.connector == "kvlog":  # issue 23: the scheduler's CPU tier log replays exactly
        assert res.tier is not None and res.tier.exact, res.tier
        assert res.tier.lookups > 0 and res.tier.stores_prepared > 0
        _tier_whatifs(cfg, tmp_path)
        # vLLM's plain worker ran beside kvlog's connector to the end (the table's baseline)
        assert res.plain_s > 0 and "plain shadow" not in res.details, res.details
        if cfg.defrag:  # (its step records mark where a step's records end)
            _declarations_ride_with_submissions(tmp_path / f"{cfg.name}.kvlog", res.flush_steps)
    if cfg.defrag:
        fired = f"defrag planned swaps on {res.swap_steps}/{res.steps} steps"
        if cfg.name in harness.DEFRAG_MOST_STEPS:
            # issue 10: threshold 0 on the harness's most-steps workload, defrag fires on
            # most steps (it measures 57-75%): it cannot on steps whose pool is full or
            # compact, or whose only holes were freed this step (quarantined) or are pinned
            assert res.swap_steps * 2 > res.steps, fired
        else:
            # the default workload (96 blocks of 16 tokens, threshold 1) keeps the pool full
            # or compact on most steps: about 15-30% of steps
            floor = max(50, res.steps // 10)
            assert res.swap_steps >= floor, fired
        assert res.table_checks > 0


def _declarations_ride_with_submissions(log: Path, flush_steps: int) -> None:
    """The connector's step is one unit of work (issue 33): ``bind_connector_metadata``'s
    declarations and ``start_load_kv``'s submissions are one record. A record of
    declarations alone is followed by one of submissions alone only where ``bind`` had to
    apply them first: a step with ``jobs_to_flush`` waits for those stores there (a load's
    hold, applied right before its declaration, also splits them, but comes between). The
    runner's step records lie between two steps' records: without defrag there are none,
    and a step that only declares is followed by the next that only submits."""
    from kvlog.events import LoadRequested, StoreRequested, TransferBatch, TransferSubmitted
    from kvlog.log import LogReader

    def kinds(record: object) -> set[type]:
        events = record.events if isinstance(record, TransferBatch) else [record]
        return {type(e) for e in events}

    requests, submitted = {StoreRequested, LoadRequested}, {TransferSubmitted}
    shapes = [kinds(r) for _, r in LogReader(log).records()]
    split = [
        i for i in range(len(shapes) - 1) if shapes[i] <= requests and shapes[i + 1] == submitted
    ]
    mixed = sum(1 for k in shapes if k & requests and submitted <= k)
    assert len(split) <= flush_steps, f"{len(split)} steps logged apart, {flush_steps} flushed"
    assert mixed > len(split), f"{mixed} steps declared and submitted jobs in one record"


TIER_LINES: list[str] = []


def _tier_whatifs(cfg: harness.RunConfig, tmp_path: Path) -> None:
    """What-ifs run on the recorded tier log: LRU, ARC and the optimum at the run's size."""
    from kvlog.integrations.vllm import scheduler_log_path
    from kvlog.tier.replay import replay_tier
    from kvlog.tier.trace import accesses_from_log
    from kvlog.tier.variants import TierVariant
    from kvlog.tier.whatif import run_variant

    log = scheduler_log_path(str(tmp_path / f"{cfg.name}.kvlog"))
    accesses = accesses_from_log(log)
    rates = {}
    for eviction in ("lru", "arc", "opt"):
        variant = TierVariant(eviction, cfg.cpu_chunks, keys_per_step=4)
        result = run_variant(accesses, variant)
        assert result.tally.blocks_asked > 0
        rates[eviction] = result.hit_rate
    tier = replay_tier(log)
    TIER_LINES.append(
        f"{cfg.name}: tier log {tier.calls} calls, {tier.compared} answers equal "
        f"({tier.lookups} lookups); what-if hit rates at {cfg.cpu_chunks} chunks: "
        + ", ".join(f"{k} {v:.3f}" for k, v in rates.items())
    )


def test_matrix_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Print the figures of every configuration above (also on failures)."""
    if not RESULTS:
        pytest.skip("no configuration ran")
    with capsys.disabled():
        print()
        print(harness.format_table(RESULTS))
        print("\n".join(TIER_LINES))


def test_harness_is_clean_with_vllm_semantics_and_no_defrag(
    tmp_path: Path,
) -> None:
    """A plain worker with vLLM's own transfer semantics and no defrag: nothing to find."""
    res = harness.run_config(harness.REFERENCE_CLEAN, str(tmp_path))
    assert res.ok, res.summary()
    assert res.loads_done > 0 and res.preemptions >= 30


def test_harness_catches_a_worker_that_ignores_defrag(tmp_path: Path) -> None:
    """The same worker with kvlog's defrag moving blocks under it must be caught."""
    res = harness.run_config(harness.REFERENCE_UNAWARE, str(tmp_path))
    assert not res.errors, res.summary()
    assert res.live_bad_slots > 0 and res.store_bad_blocks > 0 and res.load_bad_blocks > 0


def test_vllm_chunk_mapping_follows_block_indices_and_partial_chunks() -> None:
    """The harness's restatement of vLLM 0.33's ``transfer_async`` mapping on hand examples."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    # one group, 5 blocks starting at block index 3 of the request, 4 blocks per chunk:
    # the last sub-block of the first chunk, then the whole second chunk
    spec = GPULoadStoreSpec([10, 11, 12, 13, 14], group_sizes=[5], block_indices=[3])
    got = harness.vllm_chunk_mapping(spec, [7, 8], 4)
    assert got == [(10, 7, 3, 3), (11, 8, 0, 4), (12, 8, 1, 5), (13, 8, 2, 6), (14, 8, 3, 7)]
    # a partial last chunk
    spec = GPULoadStoreSpec([1, 2, 3], group_sizes=[3], block_indices=[0])
    assert harness.vllm_chunk_mapping(spec, [5, 6], 2) == [
        (1, 5, 0, 0),
        (2, 5, 1, 1),
        (3, 6, 0, 2),
    ]
    # two groups, each with its own skip
    spec = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[1, 3], block_indices=[1, 2])
    assert harness.vllm_chunk_mapping(spec, [0, 1, 2], 2) == [
        (1, 0, 1, 1),
        (2, 1, 0, 2),
        (3, 1, 1, 3),
        (4, 2, 0, 4),
    ]
    with pytest.raises(AssertionError):
        harness.vllm_chunk_mapping(spec, [0, 1], 2)


def test_vllm_chunk_mapping_agrees_with_vllms_sub_block_pointers() -> None:
    """Per group, vLLM's own ``compute_sub_block_ptrs`` (the CPU side of ``transfer_async``)
    lands each GPU block where the harness's mapping says."""
    import random

    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

    rng = random.Random(0)
    page = 64
    for _ in range(200):
        bpc = rng.choice((1, 2, 3, 4))
        first, size = rng.randrange(0, 12), rng.randrange(1, 12)
        count = -(-(size + first % bpc) // bpc)
        chunks = rng.sample(range(40), count)
        cpu = torch.zeros((40, bpc * page), dtype=torch.int8)
        ptrs = np.empty(size, dtype=np.uint64)
        compute_sub_block_ptrs(np.array(chunks), bpc, ptrs, cpu, skip_count=first % bpc)
        offsets = (ptrs - np.uint64(cpu.data_ptr())).astype(np.int64)
        row = cpu.stride(0)
        want = [(int(o // row), int(o % row // page)) for o in offsets]
        spec = GPULoadStoreSpec(
            list(range(100, 100 + size)), group_sizes=[size], block_indices=[first]
        )
        got = [(c, j) for _, c, j, _ in harness.vllm_chunk_mapping(spec, chunks, bpc)]
        assert got == want, (bpc, first, size, chunks)


@pytest.mark.parametrize(
    "name",
    ["nopc-bpc2-async", "pc-bpc4-sync"],  # the second has BlocksReleased and skewed chunks
)
def test_replay_execute_checks_every_stored_and_loaded_block(name: str, tmp_path: Path) -> None:
    """``kvlog replay --execute`` of a log recorded through the vLLM connector (deferred jobs,
    ``TransferSubmitted``, ``group_sizes``/``block_indices``, ``BlocksReleased``): the canary
    follows the sub-blocks of every plan, so every CPU sub-block a successful store wrote is
    read back at the end with the bytes it should hold; and, folding the log once more with
    a check after every load, every block a load filled holds the bytes it was stored with."""
    from kvlog import replay
    from kvlog.analysis.canary import make_canary_executor
    from kvlog.events import TransferBatch, TransferFinished, TransferPlan
    from kvlog.runtime.fold import Fold
    from kvlog.runtime.machine import Observer

    (cfg,) = [c for c in harness.CI_MATRIX if c.name == name]
    res = harness.run_config(cfg, str(tmp_path))
    assert res.ok and res.stores_done > 0 and res.loads_done > 0, res.summary()
    log = str(tmp_path / f"{cfg.name}.kvlog")

    result = replay(log, execute=True)
    canary = result.canary
    assert result.ok and canary is not None and canary.ok, canary

    fold = Fold(log)
    config = next(iter(fold.reader.records()))[1]
    executor, tracker = make_canary_executor(config)  # type: ignore[arg-type]

    class Loads(Observer):
        """After each finished load: every block it filled holds known bytes, and every
        live block reads back right. Also sums up what successful stores wrote."""

        def __init__(self) -> None:
            self.planned: dict[int, TransferPlan] = {}
            self.stored: set[int] = set()
            self.loaded = 0

        def after(self, state: object, event: object, plans: list[object]) -> None:
            for plan in plans:
                if isinstance(plan, TransferPlan):
                    self.planned[plan.job_id] = plan
            fine = event.events if isinstance(event, TransferBatch) else [event]
            for finished in fine:  # a poll's finishes are one batch
                if isinstance(finished, TransferFinished) and finished.success:
                    self.finished(state, finished)

        def finished(self, state: object, event: TransferFinished) -> None:
            plan = self.planned.pop(event.job_id)
            if plan.kind == "store":
                self.stored.update(dst for _, dst in plan.pairs)
                return
            gpu = [state.unresolve(p) for _, p in plan.pairs]  # type: ignore[attr-defined]
            assert all(tracker.gpu_tokens[b] >= 0 for b in gpu), (event, plan)
            report = tracker.check(state, include_cpu=False)  # type: ignore[arg-type]
            assert report.ok, report
            self.loaded += len(gpu)

    loads = Loads()
    fold.lane.machine.executor = executor
    fold.lane.machine.observers += [tracker, loads]  # type: ignore[list-item]
    assert fold.run().divergence is None
    executor.shutdown()
    assert loads.loaded > 0 and len(loads.stored) > 0
    assert (canary.num_cpu_checked, canary.num_cpu_skipped) == (len(loads.stored), 0)
