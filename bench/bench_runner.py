"""kvlog at serving scale inside vLLM 0.33's real v1 scheduler, next to the plugin it replaces.

    python bench/bench_runner.py                 # prefix caching off, then on; 800 timed steps
    python bench/bench_runner.py --quick         # 300 timed steps
    python bench/bench_runner.py --pc on --steps 400 --blocks 8192 --prompt 2000
    python bench/bench_runner.py --profile update_state   # cProfile of one call (slow)

Needs the real-vLLM virtualenv (README, "The real-vLLM stage"); kvlog comes from this tree
(``PYTHONPATH=.`` where kvlog is not installed in that virtualenv).

vLLM's own ``Scheduler`` (KVCacheManager, BlockPool, chunked prefill, preemption, prefix
caching off or on) at the scale a server runs it: 16,384 blocks of 128 tokens, 256
sequences, 8,192 batched tokens, prompts of about 3,000 tokens built on a few shared
prefixes, a share of them sent again later (their stored chunks come back from the CPU
tier), all settable. Offloading goes through vLLM's ``OffloadingConnector`` flow with
``KvlogOffloadingConnector`` as the worker side. A fake model runner (``tests/vllm/harness``'s
``Run``, its byte checks off: this measures, ``tests/vllm_harness.py`` checks) makes
vllm-gaudi's HPU runner's calls on kvlog every step, the log at the integration's default
(``background``)::

    defragmenter.update_state(new | cached, finished_req_ids); defragmenter.defragment()
    connector.bind_connector_metadata(meta); connector.start_load_kv(None)
    defragmenter.resolve_all(<the decodes' block tables>)                # the forward's,
    block_number.apply_(defragmenter.resolve)   # the decodes' slots    # as vllm-gaudi's
    [defragmenter.resolve(b) for b in blocks]   # each prefill's blocks # runner resolves
    connector.wait_for_save(); connector.get_finished(finished)
    connector.build_connector_worker_meta(); connector.clear_connector_metadata()

With ``--switch`` the runner runs under kvlog's Gaudi switch, as a deployment does
(``KVLOG_GAUDI=1``, ``kvlog.integrations.gaudi``): its ``run_defragmenter`` passes the
scheduler output's preemptions and whole tables, and its decode hook replaces the decodes'
``resolve_all`` and per-slot ``resolve`` with one
``defragmenter.resolve_table(<the decodes' rows of the block-table tensor>)``;

and, on the same calls in the same loop, the plugin's defragmenter
(``tests/support/seed_reference.py``: its sorts, its per-id resolve, ``index_select`` /
``index_copy_`` on its own copy of the KV tensors), and the connector's calls on vLLM's own
``OffloadingConnector`` with the harness's plain worker (``tests/vllm/harness/shadow.py``:
copies at submit, no books, its own copy of the tensors and of each step's metadata): the
plugin's whole cost, defragmenter and offloading worker. The KV tensors are small (2 layers,
one head of 4 int16 per slot): the copies cost little on both sides, the bookkeeping is
what is compared. Each step's time is taken per call; the first ``--warmup`` steps (the
pool filling) are not counted.

Printed per prefix-caching mode: microseconds per step (mean; median in brackets) of vLLM's
``schedule()`` + ``update_from_output()`` (the CPU tier log's appends inside them moved to
kvlog), the seed's defragmenter calls, the plain worker's calls, kvlog's calls split by
call, kvlog's copies, its log appends (the share of its time spent handing records to the
log writer), and the ratios kvlog / seed, kvlog / scheduler and kvlog / (seed + plain
worker); then what the workload did in the timed steps (requests scheduled and ids resolved
a step, preemptions, stores, loads, steps with swaps). The log replays
with verification at the end (``--no-replay`` skips it).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import gc
import mmap
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root: tests.* helpers

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvlog.synth.vllm_stubs import VOCAB, build_scheduler  # noqa: E402

try:
    from tests.vllm.harness import (
        KvCache,
        Run,
        RunConfig,
        Sequence_,
        make_defragmenter,
        make_request,
    )
    from tests.vllm.harness.configs import KVLOG_CONNECTOR
    from tests.vllm.harness.shadow import PlainShadow
except ImportError as exc:  # pragma: no cover - run from a checkout
    raise SystemExit(f"bench_runner needs the repository's tests/vllm/harness: {exc}") from exc

CALLS = (
    "update_state",
    "defragment",
    "run_defragmenter",
    "resolve_all",
    "resolve",
    "resolve_table",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
"""kvlog's calls a step, in the runner's order (``tier log`` and ``log`` are shares)."""


@dataclasses.dataclass(frozen=True)
class Scale:
    """The serving-scale workload and vLLM's limits."""

    blocks: int = 16384
    block_size: int = 128
    seqs: int = 256
    batched_tokens: int = 8192
    prompt: int = 3000  # mean prompt length, tokens
    prompt_spread: float = 0.2  # prompts uniform in prompt * (1 +- spread)
    prefixes: int = 8  # shared prefixes
    prefix_share: float = 0.5  # a prompt's shared prefix, as a share of its length
    resend: float = 0.3  # share of prompts that repeat an earlier one
    output_min: int = 32
    output_max: int = 2048
    blocks_per_chunk: int = 1
    cpu_blocks: int = 16384  # CPU tier capacity, GPU blocks' worth
    threshold: int = 32  # the plugin's VLLM_DEFRAG_THRESHOLD default
    max_waiting: int = 64
    # the Gaudi switch: its call site (preemptions passed) and its decode hook (the decodes'
    # tables resolved in one resolve_table) instead of the runner's own calls
    switch: bool = False
    log_sync: str = "background"
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        longest = int(self.prompt * (1 + self.prompt_spread)) + self.output_max + 1
        return -(-longest // self.block_size) * self.block_size


def make_requests(scale: Scale, count: int) -> list[Sequence_]:
    """``count`` requests: a shared prefix (one of ``prefixes``) and a unique suffix, about
    ``resend`` of them an earlier prompt again (its stored chunks are on the CPU tier by
    then, or its blocks still cached with prefix caching). Outputs are the request's own
    seeded tokens (no canaries: nothing is checked byte by byte here)."""
    rng = random.Random(scale.seed)
    longest = int(scale.prompt * (1 + scale.prompt_spread))
    heads = [[rng.randrange(2, VOCAB - 1) for _ in range(longest)] for _ in range(scale.prefixes)]
    out: list[Sequence_] = []
    for i in range(count):
        if i >= 2 * scale.seqs and rng.random() < scale.resend:
            old = out[rng.randrange(0, i - scale.seqs)]
            prompt, max_tokens = old.prompt, old.max_tokens
        else:
            spread = scale.prompt * scale.prompt_spread
            n = max(1, int(scale.prompt + rng.uniform(-spread, spread)))
            shared = int(n * scale.prefix_share)
            head = rng.choice(heads)[:shared]
            prompt = head + [rng.randrange(2, VOCAB - 1) for _ in range(n - shared)]
            max_tokens = rng.randrange(scale.output_min, scale.output_max + 1)
        tokens = prompt + [1 + rng.randrange(VOCAB - 2) for _ in range(max_tokens)]
        out.append(Sequence_(f"req-{i}", prompt, max_tokens, tokens, np.empty(0, np.uint64)))
    return out


def run_config(scale: Scale, prefix_caching: bool) -> RunConfig:
    return RunConfig(
        name=f"scale-{'pc' if prefix_caching else 'nopc'}",
        prefix_caching=prefix_caching,
        blocks_per_chunk=scale.blocks_per_chunk,
        sync_loads=False,
        v2_runner=False,
        async_scheduling=False,
        pass_preempted=scale.switch,
        log_sync=scale.log_sync,
        num_gpu_blocks=scale.blocks,
        block_size=scale.block_size,
        threshold=scale.threshold,
        max_num_seqs=scale.seqs,
        max_num_batched_tokens=scale.batched_tokens,
        num_layers=2,
        num_kv_heads=1,
        head_size=4,
        cpu_chunks=-(-scale.cpu_blocks // scale.blocks_per_chunk),
        max_waiting=scale.max_waiting,
        abort_every=0,
        seed=scale.seed,
    )


class StepClock:
    """Seconds per call name, per step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, name: str, seconds: float) -> None:
        self.now[name] = self.now.get(name, 0.0) + seconds

    def end_step(self) -> None:
        self.steps.append(self.now)
        self.now = {}

    def per_step(self, name: str, first: int) -> list[float]:
        return [s.get(name, 0.0) for s in self.steps[first:]]


class ScaleRun(Run):
    """The harness's run with its byte checks off, every kvlog call timed by name, the
    loop fed to keep ``max_waiting`` requests queued, and ``warmup + steps`` steps run."""

    def __init__(
        self, scale: Scale, prefix_caching: bool, steps: int, warmup: int, workdir: str
    ) -> None:
        self.scale = scale
        super().__init__(run_config(scale, prefix_caching), workdir)
        self.seqs = {s.req_id: s for s in make_requests(scale, self._requests_needed(steps))}
        self.result.requests = len(self.seqs)
        self.clock = StepClock()
        self.total_steps = warmup + steps
        self.warmup = warmup
        self.at_warmup: dict[str, int] = {}
        self.counts: dict[str, int] = {"scheduled": 0, "resolved": 0, "swap_steps": 0}
        self.profile: cProfile.Profile | None = None
        self.profile_calls: frozenset[str] = frozenset()

    def _requests_needed(self, steps: int) -> int:
        s = self.scale
        per_step = s.batched_tokens / max(s.prompt, 1)
        return int(per_step * (steps + 400) * 1.5) + 2 * s.seqs

    # -- set-up: build_vllm's, with the scale's max_model_len --------------------------------
    def _setup(self) -> None:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        cfg = self.cfg
        page = 2 * cfg.num_layers * cfg.block_size * cfg.num_kv_heads * cfg.head_size * 2
        chunk_bytes = -(-page * cfg.blocks_per_chunk // mmap.PAGESIZE) * mmap.PAGESIZE
        extra = {
            "cpu_bytes_to_use": cfg.cpu_chunks * chunk_bytes,
            "blocks_per_chunk": cfg.blocks_per_chunk,
            "offload_prompt_only": cfg.offload_prompt_only,
            "kvlog_backend": cfg.backend,
        }
        name, module = KVLOG_CONNECTOR
        transfer = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        old = {k: os.environ.get(k) for k in ("VLLM_USE_V2_MODEL_RUNNER", "KVLOG_PATH")}
        os.environ.update(VLLM_USE_V2_MODEL_RUNNER="0", KVLOG_PATH=self.log_path)
        try:
            self.vllm_config, self.kv_cache_config, self.scheduler = build_scheduler(
                num_gpu_blocks=cfg.num_gpu_blocks,
                block_size=cfg.block_size,
                max_model_len=self.scale.max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                prefix_caching=cfg.prefix_caching,
                layer_names=[f"layer.{i}" for i in range(cfg.num_layers)],
                num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_size,
                dtype=torch.int16,
                kv_transfer_config=transfer,
                async_scheduling=False,
                model="kvlog-bench-runner",
            )
            self.connector = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        self._kvlog("register_kv_caches", self.connector.register_kv_caches, self.kv.kv_caches_4d())
        first = self._kvlog("OnlineDefragmenter()", make_defragmenter, self.kv, cfg, self.log_path)
        self._kvlog("warmup", first.warmup)
        self.defrag = self._kvlog(
            "OnlineDefragmenter()", make_defragmenter, self.kv, cfg, self.log_path
        )
        self.seed = _seed(self.kv, cfg)
        self.plain = PlainShadow.build(
            self.vllm_config, self.kv_cache_config, self.kv, cfg, self.result
        )
        if self.defrag.engine is not self.connector.engine:
            raise AssertionError("the defragmenter and the connector do not share an Engine")
        self._time_log()

    def _time_log(self) -> None:
        """Time the Engine's log appends (bench instrumentation: the Engine's record hook
        is wrapped, nothing else changes)."""
        engine = self.defrag.engine
        record = engine._record

        def timed(event: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return record(event)
            finally:
                self.clock.add("log", time.perf_counter() - t0)

        engine._record = timed

    # -- timing ------------------------------------------------------------------------------
    def _kvlog(self, what: str, fn: Any, *args: Any, timed: bool = True) -> Any:
        profile = self.profile if what in self.profile_calls else None
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        try:
            return super()._kvlog(what, fn, *args, timed=timed)
        finally:
            if timed:
                self.clock.add(what, time.perf_counter() - t0)
            if profile is not None:
                profile.disable()

    def _shadow(self, call: Any) -> None:
        before = self.result.seed_s
        super()._shadow(call)
        self.clock.add("seed", self.result.seed_s - before)

    def _conn(self, name: str, method: Any, *args: Any) -> Any:
        before = self.result.plain_s
        try:
            return super()._conn(name, method, *args)
        finally:
            self.clock.add("plain", self.result.plain_s - before)

    # -- the loop: a steady queue, warmup + steps steps --------------------------------------
    def _loop(self) -> None:
        pending = list(self.seqs.values())
        pending.reverse()
        while self.step < self.total_steps:
            if self.step == self.warmup:
                self.at_warmup = self._counters()
            while pending and len(self.scheduler.waiting) < self.cfg.max_waiting:
                self.scheduler.add_request(make_request(pending.pop(), self.bs))
            if not self.scheduler.has_requests():
                break
            sched0, tier0 = self.result.sched_s, self.result.tier_s
            copy0 = self.result.copy_s
            t0 = time.perf_counter()
            so = self.scheduler.schedule()
            self.result.sched_s += time.perf_counter() - t0
            mro = self._worker_step(so)
            self._update(so, mro)
            tier = self.result.tier_s - tier0
            self.clock.add("scheduler", self.result.sched_s - sched0 - tier)
            self.clock.add("tier log", tier)
            self.clock.add("copies", self.result.copy_s - copy0)
            self.clock.end_step()
            self.step += 1

    def _counters(self) -> dict[str, int]:
        r = self.result
        return {
            "scheduled a step": self.counts["scheduled"],
            "ids resolved a step": self.counts["resolved"],
            "preemptions": r.preemptions,
            "stores": r.stores,
            "loads": r.loads_sync + r.loads_async,
            "steps with swaps": r.swap_steps,
            "swapped blocks": r.swaps,
        }

    # -- the checks are off: this measures ---------------------------------------------------
    def _check_tables(self, so: Any) -> None:
        del so

    def _check_live(self, so: Any) -> None:
        self.counts["scheduled"] += len(so.num_scheduled_tokens)

    def _record_jobs(self, meta: Any) -> None:
        self.result.stores += len(meta.store_jobs)
        for job in meta.load_jobs.values():
            if job.sync:
                self.result.loads_sync += 1
            else:
                self.result.loads_async += 1

    def _check_completed(self, completed: dict[int, int]) -> None:
        del completed

    def _forward(self, so: Any) -> dict[str, list[int]]:
        reqs, positions, _ = self._write_set(so)  # not timed: the runner's own work
        if reqs:  # resolved as vllm-gaudi's runner does (``Run._runner_slots``), no writes
            self.counts["resolved"] += sum(-(-int(p[-1] + 1) // self.bs) for p in positions)
            self._runner_slots(reqs, positions)
        sampled: dict[str, list[int]] = {}
        for r in reqs:
            if not self.scheduler.requests[r].is_prefill_chunk:
                sampled[r] = [self.seqs[r].tokens[self.computed[r]]]
        return sampled

    def _finish(self) -> None:
        """Close the connector and the Engine; replay the log (``verify=True``) unless
        ``replay`` was turned off (``self.result.replay_ok`` stays None)."""
        self.connector.shutdown()
        engine = self.defrag.engine
        self.result.live_digest = engine.digest()
        engine.close()


def _seed(kv: KvCache, cfg: RunConfig) -> Any:
    from tests.support.seed_reference import SeedDefragmenter

    seed = SeedDefragmenter(threshold=cfg.threshold, prefix_caching=cfg.prefix_caching)
    seed.initialize([(k.clone(), v.clone()) for k, v in kv.layers], cfg.block_size)
    return seed


@dataclasses.dataclass
class Figures:
    """One prefix-caching mode's run: per-step microseconds (mean, median) by name."""

    prefix_caching: bool
    steps: int
    mean: dict[str, float]
    median: dict[str, float]
    counts: dict[str, float]
    replay: str
    errors: list[str]
    bulk: str = "-"
    """Of the run's whole steps, those the Engine's check took in bulk (``_bulk_steps``)."""

    def kvlog(self, how: str = "mean") -> float:
        src = self.mean if how == "mean" else self.median
        return src["kvlog"]


def measure(
    scale: Scale,
    prefix_caching: bool,
    steps: int,
    warmup: int,
    replay: bool,
    profile_call: str = "",
) -> tuple[Figures, cProfile.Profile | None]:
    with tempfile.TemporaryDirectory(prefix="kvlog-bench-runner-") as tmp:
        run = ScaleRun(scale, prefix_caching, steps, warmup, tmp)
        if profile_call:
            run.profile = cProfile.Profile()
            run.profile_calls = frozenset(
                CALLS if profile_call == "all" else profile_call.split(",")
            )
        result = run.execute()
        replayed = "-"
        if replay and not result.errors:
            from kvlog import replay as replay_log

            done = replay_log(run.log_path, verify=True)
            ok = done.ok and done.final_digest == result.live_digest
            replayed = "ok" if ok else f"FAILED ({done.divergence})"
        figures = _figures(run, prefix_caching, warmup, replayed)
        if not result.errors:
            figures.bulk = _bulk_steps(run.log_path)
    gc.collect()
    return figures, run.profile


def _bulk_steps(path: str) -> str:
    """How many of the log's steps (warm-up included) the Engine's check took in bulk, of
    all of them: a step checked in bulk is logged packed (``StepPacked``), any other whole
    step as it came (``StepScheduled``), a step the books took apart as its fine-grained
    events (``StepEnded`` closes it)."""
    from kvlog.log import read_log

    kinds = collections.Counter(type(record).__name__ for _, record in read_log(path))
    steps = kinds["StepPacked"] + kinds["StepScheduled"] + kinds["StepEnded"]
    return f"{kinds['StepPacked']:,} of {steps:,}"


def _figures(run: ScaleRun, prefix_caching: bool, warmup: int, replayed: str) -> Figures:
    clock = run.clock
    timed = len(clock.steps) - warmup
    names = (*CALLS, "log", "tier log", "copies", "scheduler", "seed", "plain")
    series = {n: clock.per_step(n, warmup) for n in names}
    series["kvlog"] = [
        sum(parts) for parts in zip(*(series[n] for n in (*CALLS, "tier log")), strict=True)
    ]
    mean = {n: 1e6 * statistics.fmean(v) if v else 0.0 for n, v in series.items()}
    median = {n: 1e6 * statistics.median(v) if v else 0.0 for n, v in series.items()}
    end, start = run._counters(), run.at_warmup
    counts: dict[str, float] = {k: v - start.get(k, 0) for k, v in end.items()}
    for k in ("scheduled a step", "ids resolved a step"):
        counts[k] /= max(timed, 1)
    r = run.result
    return Figures(prefix_caching, timed, mean, median, counts, replayed, list(r.errors))


def report(figs: Figures) -> str:
    m, d = figs.mean, figs.median
    lines = [
        f"prefix caching {'on' if figs.prefix_caching else 'off'}: {figs.steps} timed steps, "
        + ", ".join(f"{k} {v:,.0f}" if v >= 10 else f"{k} {v:.1f}" for k, v in figs.counts.items())
        + f"; steps in bulk {figs.bulk}; replay {figs.replay}",
        f"  {'us a step':34} {'mean':>9} {'median':>9}",
    ]

    def row(label: str, name: str) -> str:
        return f"  {label:34} {m[name]:9,.0f} {d[name]:9,.0f}"

    lines.append(row("vLLM schedule()+update_from_output()", "scheduler"))
    lines.append(row("seed defragmenter (same calls)", "seed"))
    lines.append(row("plain vLLM worker (same calls)", "plain"))
    lines.append(row("kvlog, all calls", "kvlog"))
    for name in (*CALLS, "tier log"):
        lines.append(row(f"  {name}", name))
    lines.append(row("  of it: log appends", "log"))
    lines.append(row("  of it: copies (executor)", "copies"))
    seed_ratio = m["kvlog"] / max(m["seed"], 1e-9)
    sched_ratio = m["kvlog"] / max(m["scheduler"], 1e-9)
    log_share = m["log"] / max(m["kvlog"], 1e-9)
    lines.append(
        f"  kvlog / seed {seed_ratio:.2f} (target <= 0.25), kvlog / scheduler "
        f"{sched_ratio:.2f} (target <= 0.2); log appends {100 * log_share:.0f}% of kvlog; "
        f"medians: {d['kvlog'] / max(d['seed'], 1e-9):.2f} and "
        f"{d['kvlog'] / max(d['scheduler'], 1e-9):.2f}"
    )
    if m["plain"]:
        lines.append(
            f"  kvlog / (seed + plain worker) {m['kvlog'] / max(m['seed'] + m['plain'], 1e-9):.2f}"
            f" (the plugin's whole cost in the same loop; median "
            f"{d['kvlog'] / max(d['seed'] + d['plain'], 1e-9):.2f})"
        )
    for e in figs.errors:
        lines.append(f"  ERROR {e}")
    return "\n".join(lines)


def _modes(text: str) -> Iterator[bool]:
    for part in text.split(","):
        if part not in ("off", "on"):
            raise argparse.ArgumentTypeError(f"--pc takes off, on or off,on, not {part!r}")
        yield part == "on"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Scale()
    for field in dataclasses.fields(Scale):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "switch":
            p.add_argument(
                "--switch",
                action="store_true",
                help="the runner under kvlog's Gaudi switch (KVLOG_GAUDI=1): its call site "
                "passes preemptions and whole tables, its decode hook resolves the decodes' "
                "tables in one resolve_table",
            )
        elif field.type == "bool":
            p.add_argument(flag, action="store_true")
        else:
            kind: Callable[[str], Any] = {"int": int, "float": float, "str": str}[str(field.type)]
            p.add_argument(flag, type=kind, default=getattr(d, field.name))
    p.add_argument("--pc", default="off,on", help="prefix caching: off, on or off,on")
    p.add_argument("--steps", type=int, default=800, help="timed steps")
    p.add_argument("--warmup", type=int, default=200, help="steps before the clock counts")
    p.add_argument("--quick", action="store_true", help="300 timed steps, 150 warm-up")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode (spread printed)")
    p.add_argument("--no-replay", action="store_true", help="skip the log's replay")
    p.add_argument(
        "--profile", metavar="CALLS", help="cProfile these calls (comma-separated, or all; slow)"
    )
    p.add_argument("--sort", default="tottime", help="the profile's order (pstats key)")
    p.add_argument("--top", type=int, default=40, help="the profile's rows")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 300, 150
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    scale = Scale(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Scale)})
    print(
        f"bench_runner: {scale.blocks} blocks of {scale.block_size}, {scale.seqs} seqs, "
        f"{scale.batched_tokens} batched tokens, prompts ~{scale.prompt}, outputs "
        f"{scale.output_min}-{scale.output_max}, threshold {scale.threshold}, log "
        f"{scale.log_sync}, {'switch' if scale.switch else 'runner'} call site; "
        f"{args.warmup} + {args.steps} steps",
        flush=True,
    )
    failed = False
    by_mode: dict[bool, list[Figures]] = {}
    for _ in range(args.repeat):
        for pc in _modes(args.pc):
            figs, prof = measure(
                scale, pc, args.steps, args.warmup, not args.no_replay, args.profile or ""
            )
            by_mode.setdefault(pc, []).append(figs)
            print(report(figs), flush=True)
            failed |= bool(figs.errors) or figs.replay.startswith("FAILED")
            if prof is not None:
                pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    print(summary(by_mode))
    return 1 if failed else 0


def summary(by_mode: dict[bool, list[Figures]]) -> str:
    lines = ["summary (mean us a step; min-max over runs where repeated):"]
    for pc, runs in by_mode.items():

        def spread(
            fn: Callable[[Figures], float], fmt: str = ".2f", runs: list[Figures] = runs
        ) -> str:
            vals = [fn(f) for f in runs]
            if len(vals) == 1:
                return format(vals[0], fmt)
            return f"{format(min(vals), fmt)}-{format(max(vals), fmt)}"

        lines.append(
            f"  pc {'on ' if pc else 'off'}: kvlog {spread(lambda f: f.mean['kvlog'], ',.0f')}"
            f", seed {spread(lambda f: f.mean['seed'], ',.0f')}"
            f", scheduler {spread(lambda f: f.mean['scheduler'], ',.0f')}"
            f", update_state {spread(lambda f: f.mean['update_state'], ',.0f')}"
            f", run_defragmenter {spread(lambda f: f.mean['run_defragmenter'], ',.0f')}; "
            f"kvlog/seed {spread(lambda f: f.mean['kvlog'] / max(f.mean['seed'], 1e-9))}, "
            f"kvlog/scheduler {spread(lambda f: f.mean['kvlog'] / max(f.mean['scheduler'], 1e-9))}"
        )
    if len(by_mode) == 2:
        runs = [f for mode in by_mode.values() for f in mode]
        # under the switch, update_state runs inside run_defragmenter (with defragment)
        name = "update_state" if any(f.mean["update_state"] for f in runs) else "run_defragmenter"
        off = statistics.fmean(f.mean[name] for f in by_mode[False])
        on = statistics.fmean(f.mean[name] for f in by_mode[True])
        lines.append(f"  {name} off/on: {off / max(on, 1e-9):.2f} (target within 2x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
