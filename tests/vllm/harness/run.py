"""One configuration end to end: vLLM's scheduler and connector, the fake runner calling kvlog
in vllm-gaudi's order, the checks, the replay of the log."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvlog.integrations.gaudi_decode import resolve_decode_rows
from kvlog.util import vllm_compat
from tests.vllm.harness.checks import Checks, _Abort, _LoadJob, _StoreJob
from tests.vllm.harness.configs import RunConfig
from tests.vllm.harness.gaudi_runner import KvlogCalls, runner_module
from tests.vllm.harness.kvcache import CpuReader, KvCache, ReferenceWorker
from tests.vllm.harness.results import RunResult
from tests.vllm.harness.shadow import PlainShadow
from tests.vllm.harness.vllm_objects import _env, build_vllm, make_defragmenter, make_request
from tests.vllm.harness.workload import make_workload


class Run(Checks):
    """One configuration end to end; ``execute()`` returns its :class:`RunResult`."""

    def __init__(self, cfg: RunConfig, workdir: str) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.result = RunResult(cfg)
        self.bs = cfg.block_size
        self.seqs = {s.req_id: s for s in make_workload(cfg)}
        self.result.requests = len(self.seqs)
        self.kv = KvCache(cfg)
        self.step = 0
        self.tables: dict[str, list[int]] = {}  # last vLLM table seen per request
        self.computed: dict[str, int] = {}  # tokens whose KV is written once this step ran
        self.loaded_waiting: dict[str, list[int]] = {}  # loaded, not scheduled yet: blocks
        self.preempted_ever: set[str] = set()
        self.store_jobs: dict[int, _StoreJob] = {}
        self.load_jobs: dict[int, _LoadJob] = {}
        self.cpu_ideal: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.defrag: Any = None
        self.gaudi_runner: Any = None  # vllm-gaudi's runner shape (``runner_output``)
        self.seed: Any = None  # the plugin's defragmenter, timed beside kvlog's (_shadow)
        self.plain: PlainShadow | None = None  # vLLM's plain worker beside kvlog's connector
        self.cpu_reader: CpuReader | None = None
        self.log_path = os.path.join(workdir, f"{cfg.name}.kvlog")

    # -- set-up ------------------------------------------------------------------------------
    def _kvlog(self, what: str, fn: Any, *args: Any, timed: bool = True) -> Any:
        """Call into kvlog: an exception ends the run as kvlog's error; ``timed`` calls are
        what a runner makes every step and count as kvlog's per-step cost."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:
            tb = traceback.format_exc(limit=8)
            self.result.errors.append(f"step {self.step}: {what} raised {exc!r}\n{tb}")
            raise _Abort from exc
        finally:
            if timed:
                self.result.kvlog_s += time.perf_counter() - t0

    def _setup(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        cfg = self.cfg
        self.connector: Any = None
        log_env = self.log_path if cfg.connector == "kvlog" else ""  # the scheduler's tier log
        with (
            _env("VLLM_USE_V2_MODEL_RUNNER", "1" if cfg.v2_runner else "0"),
            _env("KVLOG_PATH", log_env),
        ):
            self.vllm_config, self.kv_cache_config, self.scheduler = self._build_vllm()
            self._only_v2_runner()
            if cfg.connector != "none":
                self.connector = KVConnectorFactory.create_connector(
                    self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
                )
        if cfg.connector == "kvlog":
            # vllm-gaudi's initialize_kv_cache registers the caches with the connector first
            self._kvlog(
                "register_kv_caches", self.connector.register_kv_caches, self.kv.kv_caches_4d()
            )
        if cfg.connector == "kvlog" or cfg.defrag:
            # then warmup_model builds the defragmenter, warms it up, and builds it again
            if cfg.gaudi_warmup:
                first = self._kvlog(
                    "OnlineDefragmenter()", make_defragmenter, self.kv, cfg, self.log_path
                )
                self._kvlog("warmup", first.warmup)
            self.defrag = self._kvlog(
                "OnlineDefragmenter()", make_defragmenter, self.kv, cfg, self.log_path
            )
            self.seed = _shadow_seed(self.kv, cfg)
        if cfg.connector == "kvlog":
            ours = self._kvlog("defrag.engine", self._engine, timed=False)
            theirs = self._kvlog("connector.engine", self._conn_engine, timed=False)
            if ours is not theirs:
                raise AssertionError("the defragmenter and the connector do not share an Engine")
            self.plain = PlainShadow.build(
                self.vllm_config, self.kv_cache_config, self.kv, cfg, self.result
            )
        if cfg.connector == "reference":
            num_chunks = vllm_compat.spec_num_chunks(self.connector.connector_worker.spec)
            resolve = self.defrag.resolve if (cfg.reference_resolve and self.defrag) else None
            worker = ReferenceWorker(self.kv, cfg.blocks_per_chunk, num_chunks, resolve)
            conn_worker = self.connector.connector_worker  # 0.34: behind identity pointers
            vllm_compat.attach_worker(conn_worker, worker, type(conn_worker), self.kv_cache_config)
            self.cpu_reader = worker.reader

    def _conn(self, name: str, method: Any, *args: Any) -> Any:
        """A runner's connector call: kvlog's (``_kvlog``), then the same call on the plain
        worker's shadow (``plain_s``, not kvlog's time)."""
        out = self._kvlog(name, method, *args)
        if self.plain is not None:
            self.plain.call(name, *args)
        return out

    def _build_vllm(self) -> tuple[Any, Any, Any]:
        """``build_vllm``; where vLLM refuses the configuration on this machine (0.26's V2
        model runner requires Triton, which no CPU-only install has), the run ends saying
        so (``RunResult.cannot_run``: reported per configuration, never counted clean)."""
        try:
            return build_vllm(self.cfg)
        except Exception as exc:
            if "requires Triton" not in str(exc):
                raise
            self.result.cannot_run = "vLLM's Model Runner V2 requires Triton (not installed)"
            raise _Abort from exc

    def _only_v2_runner(self) -> None:
        """vLLM 0.34 has the V2 model runner only: a V1 configuration runs its shape (and
        the table says so)."""
        if not self.cfg.v2_runner and not hasattr(self.scheduler, "use_v2_model_runner"):
            self.cfg = dataclasses.replace(self.cfg, v2_runner=True)
            self.result.cfg = self.cfg

    def _time_copies(self) -> None:
        """Count the time the shared Engine's executor spends carrying out plans (the
        swaps and transfers on the harness's tensors) into ``copy_s``."""
        engine = self._engine()
        executor = None if engine is None else engine.executor
        if executor is not None:
            executor.execute = _timed(executor.execute, self.result, "copy_s")

    def _time_tier_log(self) -> None:
        """Count the scheduler side's CPU tier log (``TierRecorder``'s appends, which run
        inside vLLM's ``schedule()`` and ``update_from_output()``) into ``tier_s``: kvlog's
        time, not the scheduler's."""
        from kvlog.tier.record import TierRecorder

        connector = getattr(self.scheduler, "connector", None)
        recorder = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
        if isinstance(recorder, TierRecorder) and recorder.sink is not None:
            recorder.sink = _timed(recorder.sink, self.result, "tier_s")

    def _conn_engine(self) -> Any:
        return self.connector.engine

    def _engine(self) -> Any:
        return None if self.defrag is None else self.defrag.engine

    def _cpu(self) -> CpuReader:
        if self.cpu_reader is None:
            engine = self._kvlog("defrag.engine", self._engine, timed=False)
            self.cpu_reader = CpuReader.of_kvlog(self.kv, engine, self.cfg.blocks_per_chunk)
        return self.cpu_reader

    def _resolve_tables(self, tables: list[list[int]], timed: bool = False) -> list[list[int]]:
        """``resolve_all``: timed only for the forward's call (the runner's one per step)."""
        if self.defrag is None:
            return [list(t) for t in tables]
        t0 = time.perf_counter()
        out = self._kvlog("resolve_all", self.defrag.resolve_all, tables, timed=timed)
        if timed:
            self.result.defrag_s += time.perf_counter() - t0
            self._shadow(lambda seed: seed.resolve_all(tables))
        return out  # type: ignore[no-any-return]

    def _runner_slots(self, reqs: list[str], positions: list[np.ndarray]) -> list[np.ndarray]:
        """The forward's write slots, resolved as vllm-gaudi's HPU runner resolves them
        (timed, and the same calls on the seed's shadow): a decode's block table (up to its
        current token) with one ``resolve_all``, its tokens' blocks one id at a time
        (``block_number.apply_(self._resolve_block)``), or, through the Gaudi switch
        (``pass_preempted``), both from its decode hook's one ``resolve_table``; a
        prefill's blocks one id at a time (``[self._resolve_block(b) for b in blocks]``)."""
        bs, defrag = self.bs, self.defrag
        decodes = [i for i, r in enumerate(reqs) if positions[i][0] >= len(self.seqs[r].prompt)]
        prefills = sorted(set(range(len(reqs))) - set(decodes))
        ends = [-(-int(pos[-1] + 1) // bs) for pos in positions]  # blocks up to the last token
        blocks = [self.tables[r][:end] for r, end in zip(reqs, ends, strict=True)]
        slots: list[np.ndarray] = [np.empty(0, np.int64)] * len(reqs)
        if decodes and self.cfg.pass_preempted:
            tables = [blocks[i] for i in decodes]
            switched = self._switch_decodes(reqs, decodes, positions, tables)
            for i, phys in zip(decodes, switched, strict=True):
                slots[i] = phys * bs + positions[i] % bs
        elif decodes:
            self._resolve_tables([blocks[i] for i in decodes], timed=True)  # attention's tables
            logical = [np.asarray(blocks[i], np.int32)[positions[i] // bs] for i in decodes]
            ours = torch.from_numpy(np.concatenate(logical)).reshape(-1, 1)
            theirs = ours.clone()
            physical = self._defrag_call("resolve", lambda: ours.apply_(defrag.resolve))
            self._shadow(lambda seed: theirs.apply_(seed.resolve))
            split = np.split(physical.numpy().ravel().astype(np.int64), np.cumsum(
                [len(x) for x in logical])[:-1])  # fmt: skip
            for i, phys in zip(decodes, split, strict=True):
                slots[i] = phys * bs + positions[i] % bs
        if prefills:
            mine = [blocks[i] for i in prefills]
            resolved = self._defrag_call(
                "resolve", lambda: [[defrag.resolve(b) for b in ids] for ids in mine]
            )
            self._shadow(lambda seed: [[seed.resolve(b) for b in ids] for ids in mine])
            for i, phys in zip(prefills, resolved, strict=True):
                pos = positions[i]
                slots[i] = np.asarray(phys, np.int64)[pos // bs] * bs + pos % bs
        return slots

    def _switch_decodes(
        self,
        reqs: list[str],
        decodes: list[int],
        positions: list[np.ndarray],
        tables: list[list[int]],
    ) -> list[np.ndarray]:
        """The decodes' slot blocks (physical) as the Gaudi switch's decode hook
        (``kvlog.integrations.gaudi_decode``) gets them: the input batch's block-table
        tensor (the decodes' whole tables, logical, zero past each; the runner holds it,
        not timed) resolved over the columns the hook reads in one ``resolve_table``
        (timed); the method's own gathers then read physical ids. The seed's shadow makes
        the plugin's calls (``resolve_all`` of ``tables``, each decode's blocks up to its
        last token, and ``resolve`` per slot)."""
        bs, defrag = self.bs, self.defrag
        rows = [self.tables[reqs[i]] for i in decodes]
        table = np.zeros((len(rows), max(map(len, rows))), np.int32)
        for row, ids in zip(table, rows, strict=True):
            row[: len(ids)] = ids
        tensor = torch.from_numpy(table)
        contexts = np.array([int(positions[i][0]) for i in decodes])
        tokens = [len(positions[i]) for i in decodes]

        resolved = self._defrag_call(
            "resolve_table",
            lambda: resolve_decode_rows(defrag, len(rows), tokens, contexts, tensor, bs),
        ).numpy()
        slots = torch.from_numpy(np.concatenate([table[r, positions[i] // bs]
                                                 for r, i in enumerate(decodes)]))  # fmt: skip
        self._shadow(
            lambda seed: (seed.resolve_all(tables), slots.reshape(-1, 1).apply_(seed.resolve))
        )
        return [resolved[r, positions[i] // bs].astype(np.int64) for r, i in enumerate(decodes)]

    def _defrag_call(self, name: str, call: Callable[[], Any]) -> Any:
        """A timed call on kvlog's defragmenter, counted in ``defrag_s`` too."""
        t0 = time.perf_counter()
        out = self._kvlog(name, call)
        self.result.defrag_s += time.perf_counter() - t0
        return out

    def _shadow(self, call: Any) -> None:
        """The same defragmenter call on the plugin's algorithm (``seed_s``), in the same
        loop: what the runner's step cost before kvlog. Its decisions are not checked (it
        keeps its own copy of the KV tensors); a failure only ends the shadow."""
        if self.seed is None:
            return
        t0 = time.perf_counter()
        try:
            call(self.seed)
        except Exception as exc:  # the seed's own limits: the comparison stops there
            self.seed = None
            self.result.seed_s = 0.0
            self.result.note("seed shadow", f"stopped: {exc!r}")
            return
        self.result.seed_s += time.perf_counter() - t0

    # -- the loop ----------------------------------------------------------------------------
    def execute(self) -> RunResult:
        t_start = time.perf_counter()
        try:
            self._setup()
            self._time_copies()
            self._time_tier_log()
            _freeze_gc_heap()
            self.result.kvlog_s = 0.0  # per-step cost only: start-up is not counted
            self._loop()
            # the tier log's appends ran inside vLLM's schedule(): they are kvlog's
            self.result.sched_s -= self.result.tier_s
            self.result.kvlog_s += self.result.tier_s
            self._finish()
        except _Abort:
            pass
        except Exception as exc:
            self.result.errors.append(
                f"step {self.step}: harness/vLLM raised {exc!r}\n{traceback.format_exc(limit=12)}"
            )
        finally:
            gc.unfreeze()  # as vLLM's engine core does at shutdown
            self.result.steps = self.step
            self.result.wall_s = time.perf_counter() - t_start
        return self.result

    def _loop(self) -> None:
        cfg = self.cfg
        pending = [self.seqs[k] for k in self.seqs]
        pending.reverse()
        prev: tuple[Any, Any] | None = None
        burst = 0
        rng = random.Random(cfg.seed ^ 0xAB0)
        max_steps = 40 * cfg.num_requests + 2000
        while True:
            # arrivals in waves: a burst overfills the pool (preemptions), then it drains
            # (holes every step, so defrag fires)
            waiting = len(self.scheduler.waiting)
            if burst == 0 and len(self.scheduler.running) + waiting <= cfg.wave_low:
                burst = cfg.wave
            while pending and burst > 0 and waiting < cfg.max_waiting:
                seq = pending.pop()
                self.scheduler.add_request(make_request(seq, self.bs))
                waiting += 1
                burst -= 1
            if not pending and not self.scheduler.has_requests() and prev is None:
                break
            self._maybe_abort(rng)
            t0 = time.perf_counter()
            so = self.scheduler.schedule()
            self.result.sched_s += time.perf_counter() - t0
            mro = self._worker_step(so)
            if cfg.async_scheduling:
                if prev is not None:
                    self._update(*prev)
                prev = (so, mro)
                if not pending and not self.scheduler.has_requests():
                    self._update(*prev)
                    prev = None
            else:
                self._update(so, mro)
            self.step += 1
            if self.step > max_steps:
                raise AssertionError(f"no progress after {self.step} steps")

    def _maybe_abort(self, rng: random.Random) -> None:
        """A client goes away now and then (between steps, as the engine core applies it):
        any unfinished request, a load in flight or not."""
        if not self.cfg.abort_every or rng.randrange(self.cfg.abort_every):
            return
        from vllm.v1.request import RequestStatus

        live = sorted(r for r, req in self.scheduler.requests.items() if not req.is_finished())
        if not live:
            return
        r = rng.choice(live)
        status = self.scheduler.requests[r].status
        self.scheduler.finish_requests(r, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(r)
        self.finished.add(r)
        self.result.aborted += 1
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.result.aborted_loading += 1

    def _update(self, so: Any, mro: Any) -> None:
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, mro)
        self.result.sched_s += time.perf_counter() - t0
        for eco in outputs.values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished.add(out.request_id)

    # -- one worker step ---------------------------------------------------------------------
    def _worker_step(self, so: Any) -> Any:
        cfg = self.cfg
        self._observe_schedule(so)
        if self.defrag is not None and cfg.defrag:
            self._run_defragmenter(so)
            self._check_tables(so)
        if self.connector is None:
            self._check_live(so)
            sampled = self._forward(so)
            return self._runner_output(so, sampled, None)
        meta = so.kv_connector_metadata
        if self.plain is not None:  # before kvlog's connector can change it
            self.plain.begin_step(meta)
        self._record_jobs(meta)
        self.result.flush_steps += bool(meta.jobs_to_flush)
        if cfg.runner_output != "vllm" and so.total_num_scheduled_tokens:
            sampled, output = self._gaudi_runner_step(so)
        else:  # vLLM's runner; vllm-gaudi's too on a step with nothing scheduled
            sampled, output = self._vllm_runner_step(so)
        worker_meta = output.kv_connector_worker_meta
        if worker_meta is not None:
            done = worker_meta.completed_jobs
            if so.total_num_scheduled_tokens:
                self.result.completions_forward += len(done)
            else:
                self.result.completions_idle += len(done)
            self._check_completed(done)
        return self._runner_output(so, sampled, output)

    def _vllm_runner_step(self, so: Any) -> tuple[dict[str, list[int]], Any]:
        """vLLM's GPU runner's connector calls around the forward (``order``: its own, or
        vllm-gaudi's), and the step's whole ``KVConnectorOutput``."""
        from vllm.v1.outputs import KVConnectorOutput

        cfg = self.cfg
        meta = so.kv_connector_metadata
        conn = KvlogCalls(self._conn, self.connector)
        if cfg.order == "gpu":
            conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        load_first = cfg.order == "gaudi" or getattr(so, "has_sync_kv_loads", False)
        if load_first:
            conn.start_load_kv(None)
        self._check_live(so)
        sampled = self._forward(so)
        if not load_first:
            conn.start_load_kv(None)
        conn.wait_for_save()
        sending, recving = conn.get_finished(so.finished_req_ids)
        worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        output = KVConnectorOutput(
            finished_sending=sending or set(),
            finished_recving=recving or set(),
            kv_connector_worker_meta=worker_meta,
        )
        return sampled, output

    def _gaudi_runner_step(self, so: Any) -> tuple[dict[str, list[int]], Any]:
        """vllm-gaudi's forward step (``harness.gaudi_runner``: its connector lines around
        the forward, its ``KVConnectorOutput``; the Gaudi switch applied with
        ``gaudi+switch``), each connector call through ``_kvlog``."""
        if self.gaudi_runner is None:
            calls = KvlogCalls(self._conn, self.connector)
            module = runner_module(lambda: calls, self.cfg.runner_output == "gaudi+switch")
            self.gaudi_runner = module.HPUModelRunner(self._checked_forward)
        return self.gaudi_runner.sample_tokens(so)  # type: ignore[no-any-return]

    def _checked_forward(self, so: Any) -> dict[str, list[int]]:
        self._check_live(so)
        return self._forward(so)

    @staticmethod
    def _runner_output(so: Any, sampled: dict[str, list[int]], kv_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            **vllm_compat.runner_output_fields(ModelRunnerOutput, req_ids),
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kv_output,
        )

    def _observe_schedule(self, so: Any) -> None:
        manager = self.scheduler.kv_cache_manager
        self.result.preemptions += len(so.preempted_req_ids or ())
        for r in so.preempted_req_ids or ():
            self.preempted_ever.add(r)
        for r in (*so.finished_req_ids, *so.num_scheduled_tokens):
            self.loaded_waiting.pop(r, None)
        if so.finished_req_ids:  # stores still to read blocks vLLM has already freed
            self.result.finished_stores += sum(
                job.req_id in so.finished_req_ids for job in self.store_jobs.values()
            )
        for r in so.num_scheduled_tokens:
            self.computed[r] = self.scheduler.requests[r].num_computed_tokens
        for r, req in self.scheduler.requests.items():
            ids = manager.get_block_ids(r)
            if ids and ids[0]:
                self.tables[r] = list(ids[0])
            elif r in self.tables and not req.is_finished():
                del self.tables[r]

    def _run_defragmenter(self, so: Any) -> None:
        """vllm-gaudi's ``run_defragmenter``, verbatim in effect."""

        def flatten(groups: Sequence[Sequence[int]]) -> list[int]:
            return [b for g in groups for b in g]

        new = {r.req_id: flatten(r.block_ids) for r in so.scheduled_new_reqs if r.block_ids}
        cached_reqs = so.scheduled_cached_reqs
        cached = {
            req_id: flatten(blocks)
            for req_id, blocks in zip(cached_reqs.req_ids, cached_reqs.new_block_ids, strict=True)
            if blocks
        }
        t0 = time.perf_counter()
        if self.cfg.pass_preempted:  # the Gaudi switch (KVLOG_GAUDI=1): kvlog's own call site
            from kvlog.integrations.gaudi import run_defragmenter

            runner = SimpleNamespace(defragmenter=self.defrag, kv_caches=self.kv)
            self._kvlog("run_defragmenter", lambda: run_defragmenter(runner, so))
        else:
            self._kvlog(
                "update_state",
                lambda: self.defrag.update_state(new | cached, so.finished_req_ids),
            )
            self._kvlog("defragment", self.defrag.defragment)
        self.result.defrag_s += time.perf_counter() - t0
        if self.seed is not None:  # the plugin raises KeyError for a request it never saw
            finished = [r for r in so.finished_req_ids if r in self.seed.req_blocks]
            self._shadow(
                lambda seed: (seed.update_state(new | cached, finished), seed.defragment())
            )
        plan = getattr(self.defrag, "last_swap", None)
        if plan is not None and plan.pairs:
            self.result.swaps += len(plan.pairs)
            self.result.swap_steps += 1

    # -- (3) the forward pass ----------------------------------------------------------------
    def _forward(self, so: Any) -> dict[str, list[int]]:
        reqs, positions, _ = self._write_set(so)
        if reqs:
            if self.defrag is None:
                slots = self._physical_slots(reqs, positions, timed=True)
            else:
                slots = self._runner_slots(reqs, positions)
            for r, pos, phys in zip(reqs, positions, slots, strict=True):
                self.kv.write(phys, self.seqs[r].hashes[pos])
        sampled: dict[str, list[int]] = {}
        for r in so.num_scheduled_tokens:
            req = self.scheduler.requests[r]
            if req.is_prefill_chunk:
                continue
            seq = self.seqs[r]
            nxt = self.computed[r]
            if nxt >= len(seq.tokens):
                raise AssertionError(f"{r}: asked to sample position {nxt} past its sequence")
            sampled[r] = [seq.tokens[nxt]]
        return sampled

    # -- the end -----------------------------------------------------------------------------
    def _finish(self) -> None:
        r = self.result
        r.finished = len(self.finished)
        for req_id, seq in self.seqs.items():
            got = self.outputs.get(req_id, [])
            want = seq.tokens[len(seq.prompt) :]
            if req_id in self.aborted:
                want = want[: len(got)]
            if got != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), "-"
                )
                r.token_mismatches += 1
                r.note(
                    "tokens",
                    f"{req_id}: vLLM returned {len(got)} tokens, expected "
                    f"{len(want)} (first difference at "
                    f"{first})",
                )
        for job_id in list(self.store_jobs) + list(self.load_jobs):
            r.note("harness", f"job {job_id} never reported complete")
        if self.connector is not None:
            self._kvlog("connector.shutdown", self.connector.shutdown, timed=False)
        if self.plain is not None:
            self.plain.shutdown()
        self._replay_tier()
        engine = self._engine()
        if engine is None:
            return
        r.live_digest = self._kvlog("engine.digest", engine.digest, timed=False)
        self._kvlog("engine.close", engine.close, timed=False)
        from kvlog import replay

        result = replay(self.log_path, verify=True)
        r.replay_digest = result.final_digest
        r.replay_ok = result.ok and result.final_digest == r.live_digest
        if not r.replay_ok:
            r.note(
                "replay",
                f"divergence {result.divergence}; replay digest "
                f"{result.final_digest} live {r.live_digest}",
            )


def _replay_tier(self: Run) -> None:
    """The scheduler side's CPU tier log (kvlog connector runs): closed, then refolded by
    the tier reducer with every recorded answer compared (``RunResult.tier``)."""
    connector = getattr(self.scheduler, "connector", None)
    if connector is None or getattr(connector, "tier_engine", None) is None:
        return
    from kvlog.integrations.vllm import scheduler_log_path
    from kvlog.tier.replay import replay_tier

    self._kvlog("scheduler connector.shutdown", connector.shutdown, timed=False)
    self.result.tier = replay_tier(scheduler_log_path(self.log_path))
    if not self.result.tier.exact:
        self.result.note("tier", f"the CPU tier does not replay: {self.result.tier}")


Run._replay_tier = _replay_tier  # type: ignore[attr-defined]


def run_config(cfg: RunConfig, workdir: str | None = None) -> RunResult:
    try:
        if workdir is None:
            with tempfile.TemporaryDirectory(prefix="kvlog-vllm-") as tmp:
                return Run(cfg, tmp).execute()
        return Run(cfg, workdir).execute()
    finally:
        # kvlog finds a session by its tensors' storage: let the last run's objects go before
        # the next run's tensors can land at the same addresses
        gc.collect()


def _freeze_gc_heap() -> None:
    """What vLLM's engine core and GPU worker do once start-up is over
    (``vllm.utils.gc_utils.freeze_gc_heap``): collect, then move every object alive to
    the permanent generation, so that the collector no longer scans the start-up heap
    (vLLM's modules, the model, the KV caches) during serving."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


def _shadow_seed(kv: KvCache, cfg: RunConfig) -> Any:
    """The plugin's defragmenter (``tests/support/seed_reference.py``) over a copy of the KV
    tensors, fed the runner's calls beside kvlog's; None with defrag off."""
    if not cfg.defrag:
        return None
    from tests.support.seed_reference import SeedDefragmenter

    seed = SeedDefragmenter(threshold=cfg.threshold, prefix_caching=cfg.prefix_caching)
    seed.initialize([(k.clone(), v.clone()) for k, v in kv.layers], cfg.block_size)
    return seed


def _timed(inner: Callable[[Any], Any], result: RunResult, field: str) -> Callable[[Any], Any]:
    """``inner`` with the time of each call added to ``result``'s ``field`` (seconds)."""

    def timed(arg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(arg)
        finally:
            setattr(result, field, getattr(result, field) + time.perf_counter() - t0)

    return timed
