"""kvlog inside vLLM 0.33's real v1 scheduler and offloading connector, with canary bytes.

vLLM's own ``Scheduler`` (KVCacheManager, BlockPool, chunked prefill, preemption, prefix
caching on or off) and its ``OffloadingConnector`` flow (scheduler side: vLLM's; worker side:
``kvlog.integrations.vllm.KvlogOffloadingConnector`` built by vLLM's connector factory) run on
CPU with no model. A fake model runner calls kvlog the way vllm-gaudi's HPU runner does, every
step::

    defragmenter.update_state(new | cached, scheduler_output.finished_req_ids)  # run_defragmenter
    defragmenter.defragment()
    connector.bind_connector_metadata(meta); connector.start_load_kv(None)    # before forward
    <forward: write canary bytes of every computed token at defragmenter.resolve(block)>
    connector.wait_for_save(); connector.get_finished(finished_req_ids)
    connector.build_connector_worker_meta(); connector.clear_connector_metadata()

(one family instead calls ``handle_preemptions`` before ``bind`` and starts async loads after
the forward, as vLLM's GPU runner does). The bytes of token position ``p`` of a request are a
function of the request's tokens ``0..p`` (a rolling 64-bit hash), so identical prefixes have
identical bytes and prefix-cache sharing stays checkable. Checks, independent of kvlog:

(a) before each forward, every computed slot of every running request, read at the physical
    slot kvlog resolves, holds its canary;
(b) every store, when the worker reports it, left in each CPU sub-block the canary of the GPU
    block vLLM's chunk mapping sends there (``GPULoadStoreSpec`` group sizes, block indices,
    ``block_indices[g] % blocks_per_chunk`` skip, partial last chunk: implemented here from
    vLLM's ``CPUOffloadingWorker.transfer_async``, not from kvlog);
(c) every load, when reported, delivered the stored sub-blocks into its destination blocks;
(d) kvlog's request tables equal vLLM's block ids every step (requests never preempted always;
    preempted ones too when the runner passes preemption ids; otherwise every block vLLM holds
    for a request the runner knows is used in kvlog);
(e) every request finishes with the tokens the fake model sampled; (f) kvlog raises nothing;
(g) the run's log replays (``kvlog.replay(verify=True)``) to the live digest.

Run the matrix: ``python tests/vllm_harness.py --matrix`` (``--config NAME``, ``--list``).
The pytest entry is ``tests/vllm/test_real_scheduler.py``; the harness is the package
``tests/vllm/harness/``. Only the vLLM virtualenv has vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# run as a script (``python tests/vllm_harness.py``), the repository root is not on the path,
# and Python put tests/ first, where the package tests/vllm would shadow vLLM itself
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.vllm.harness import *  # noqa: E402, F403  (``vllm_harness`` has every name)
from tests.vllm.harness import (  # noqa: E402
    CI_MATRIX,
    CONFIGS,
    DEFRAG_ONLY,
    GAUDI_RUNNER,
    REFERENCE_CLEAN,
    REFERENCE_UNAWARE,
    cost_summary,
    format_table,
    random_configs,
    run_config,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", action="store_true", help="run the whole CI matrix")
    parser.add_argument("--config", action="append", default=[], help="run this config")
    parser.add_argument("--list", action="store_true", help="list the configurations")
    parser.add_argument(
        "--self-test", action="store_true", help="also run the reference-worker self-tests"
    )
    parser.add_argument(
        "--defrag-only", action="store_true", help="also run the defragmenter-only family"
    )
    parser.add_argument(
        "--gaudi-runner",
        action="store_true",
        help="also run vllm-gaudi's runner output, with and without the Gaudi switch",
    )
    parser.add_argument(
        "--random", type=int, default=0, metavar="N", help="also run N random configurations"
    )
    parser.add_argument("--random-seed", type=int, default=0, help="seed of --random")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs in DIR")
    parser.add_argument(
        "--log-sync",
        choices=("none", "step", "always", "background"),
        help="the log's group commit for every run (default: each config's; background)",
    )
    parser.add_argument(
        "--runner-output",
        choices=("vllm", "gaudi", "gaudi+switch"),
        help="the runner's KVConnectorOutput for every vLLM-order run (default: each config's)",
    )
    args = parser.parse_args(argv)
    if args.list:
        import vllm

        print(f"# vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
        for c in CONFIGS.values():
            print(f"{c.name:32} {c.describe()}")
        return 0
    chosen = [CONFIGS[n] for n in args.config]
    if args.matrix:
        chosen += CI_MATRIX
    if args.self_test:
        chosen += [REFERENCE_CLEAN, REFERENCE_UNAWARE]
    if args.defrag_only:
        chosen += DEFRAG_ONLY
    if args.gaudi_runner:
        chosen += GAUDI_RUNNER
    chosen += random_configs(args.random, args.random_seed)
    if not chosen:
        parser.error(
            "give --matrix, --config NAME, --self-test, --defrag-only, --gaudi-runner or --random N"
        )
    if args.log_sync:
        chosen = [dataclasses.replace(c, log_sync=args.log_sync) for c in chosen]
    if args.runner_output:  # vllm-gaudi's runner has vllm-gaudi's call order
        chosen = [
            dataclasses.replace(c, runner_output=args.runner_output) if c.order == "gaudi" else c
            for c in chosen
        ]
    t0 = time.perf_counter()
    results = []
    for cfg in chosen:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        res = run_config(cfg, args.keep)
        results.append(res)
        status = "ok" if res.ok else f"CANNOT RUN: {res.cannot_run}" if res.cannot_run else "FAILED"
        print(f"{cfg.name}: {status} ({res.wall_s:.1f} s)", file=sys.stderr, flush=True)
    print(format_table(results))
    print(cost_summary(results))
    failing = [r for r in results if not r.ok and not r.cannot_run]
    for res in failing:
        print()
        print(res.summary())
    cannot = [r for r in results if r.cannot_run]
    for res in cannot:
        print(f"{res.cfg.name}: cannot run on this vLLM here: {res.cannot_run}")
    clean = len(results) - len(failing) - len(cannot)
    print(
        f"\n{clean}/{len(results)} configurations clean, {len(cannot)} cannot run on this "
        f"vLLM here, {time.perf_counter() - t0:.0f} s"
    )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
