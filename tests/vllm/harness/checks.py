"""The checks of a run, independent of kvlog: (a) live canaries, (b)/(c) every store and load,
(d) kvlog's tables against vLLM's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlog.util import vllm_compat
from tests.vllm.harness.chunks import _cdiv, vllm_chunk_mapping
from tests.vllm.harness.vllm_objects import _internal_id


class _Abort(Exception):
    pass


@dataclass
class _StoreJob:
    req_id: str
    pairs: list[tuple[int, int, int, np.ndarray, np.ndarray]]  # gpu, chunk, sub, hashes, known


@dataclass
class _LoadJob:
    req_id: str
    sync: bool
    pairs: list[tuple[int, int, int, int]]  # gpu, chunk, sub, block index in the request


class Checks:
    """The checks (a)-(d) of a :class:`~harness.run.Run` (see the package docstring)."""

    # -- (d) tables --------------------------------------------------------------------------
    def _check_tables(self, so: Any) -> None:
        """vLLM's block ids of every running request against kvlog's table for it: equal
        where kvlog can know (never preempted, or preemption ids passed); otherwise at
        least every block vLLM holds is in use in kvlog. Loaded blocks of requests that
        vLLM has not scheduled yet must be in use (held) too."""
        kvlog_tables = self._kvlog("req_blocks", lambda: self.defrag.req_blocks, timed=False)
        state = self.defrag.engine.state

        def in_use(blocks: list[int]) -> list[bool]:
            """Referenced in kvlog (by a request or a load's hold), at its physical id."""
            if not blocks:
                return []
            phys = state.resolve_array(np.asarray(blocks, dtype=np.int64))
            return [bool(x) for x in np.asarray(state.refs)[phys] > 0]

        known = set(self.seqs)
        vllm_live: set[str] = set()
        for req in self.scheduler.running:
            r = req.request_id
            vllm_live.add(r)
            want = self.tables.get(r, [])
            got = kvlog_tables.get(r)
            self.result.table_checks += 1
            strict = self.cfg.pass_preempted or r not in self.preempted_ever
            if got != want:
                if strict:
                    self.result.table_mismatches += 1
                    self.result.note(
                        "table",
                        f"step {self.step} {r}: vLLM {want} kvlog {got}"
                        f"{' (preempted before)' if r in self.preempted_ever else ''}",
                    )
                else:
                    self.result.lagging_tables += 1
                    self.result.note("lag (info)", f"step {self.step} {r}: vLLM {want} kvlog {got}")
            missed = [b for b, ok in zip(want, in_use(want), strict=True) if not ok]
            if missed:
                self.result.missed_blocks += len(missed)
                self.result.note(
                    "missed",
                    f"step {self.step} {r}: vLLM-live {missed} not used in kvlog (vLLM "
                    f"table {want}, kvlog table {got})",
                )
        for r, blocks in list(self.loaded_waiting.items()):
            req = self.scheduler.requests.get(r)
            table = self.tables.get(r, [])
            if req is None or req.is_finished() or table[: len(blocks)] != blocks:
                del self.loaded_waiting[r]  # aborted, or vLLM let the blocks go
                continue
            missed = [b for b, ok in zip(blocks, in_use(blocks), strict=True) if not ok]
            if missed:
                self.result.missed_blocks += len(missed)
                self.result.note(
                    "missed",
                    f"step {self.step} {r}: loaded blocks {missed} of a request vLLM has not "
                    "scheduled yet are not held in kvlog",
                )
        for r in kvlog_tables:
            if not _internal_id(r, known) and r not in vllm_live:
                self.result.stale_tables += 1

    # -- (a) live canaries -------------------------------------------------------------------
    def _write_set(self, so: Any) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
        reqs, positions, logical = [], [], []
        for r, n in so.num_scheduled_tokens.items():
            end = self.computed[r]
            pos = np.arange(end - n, end)
            table = np.asarray(self.tables[r], dtype=np.int64)
            reqs.append(r)
            positions.append(pos)
            logical.append(table[pos // self.bs] * self.bs + pos % self.bs)
        return reqs, positions, logical

    def _physical_slots(
        self, reqs: list[str], positions: list[np.ndarray], timed: bool = False
    ) -> list[np.ndarray]:
        phys_tables = self._resolve_tables([self.tables[r] for r in reqs], timed)
        out = []
        for table, pos in zip(phys_tables, positions, strict=True):
            arr = np.asarray(table, dtype=np.int64)
            out.append(arr[pos // self.bs] * self.bs + pos % self.bs)
        return out

    def _check_live(self, so: Any) -> None:
        _, _, written = self._write_set(so)
        being_written = np.concatenate(written) if written else np.empty(0, np.int64)
        reqs, positions = [], []
        for req in self.scheduler.running:
            r = req.request_id
            done = req.num_computed_tokens - so.num_scheduled_tokens.get(r, 0)
            if done <= 0:
                continue
            pos = np.arange(done)
            table = np.asarray(self.tables[r], dtype=np.int64)
            logical = table[pos // self.bs] * self.bs + pos % self.bs
            keep = ~np.isin(logical, being_written)
            if not keep.any():
                continue
            reqs.append(r)
            positions.append(pos[keep])
        if not reqs:
            return
        slots = self._physical_slots(reqs, positions)
        for r, pos, phys in zip(reqs, positions, slots, strict=True):
            hashes = self.seqs[r].hashes[pos]
            bad = self.kv.bad_slots(phys, hashes)
            self.result.live_slots_checked += len(pos)
            if bad.any():
                self.result.live_bad_slots += int(bad.sum())
                first = int(np.flatnonzero(bad)[0])
                p = int(pos[first])
                block = self.tables[r][p // self.bs]
                self.result.note(
                    "live",
                    f"step {self.step} {r}: {int(bad.sum())} wrong slots of {len(pos)}, first "
                    f"position {p} logical block {block} physical block "
                    f"{int(phys[first]) // self.bs} (expected canary of prefix hash "
                    f"{int(hashes[first]):#018x})",
                )

    # -- (b)/(c) transfers -------------------------------------------------------------------
    def _coverage(self, gpu_spec: Any, num_chunks: int) -> None:
        bpc = self.cfg.blocks_per_chunk
        firsts = [
            int(f)
            for f, n in zip(gpu_spec.block_indices, gpu_spec.group_sizes, strict=True)
            if int(n)
        ]
        sizes = [int(n) for n in gpu_spec.group_sizes if int(n)]
        if any(f % bpc for f in firsts):
            self.result.skipped_first += 1
        if sum(
            _cdiv(n + f % bpc, bpc) * bpc - n - f % bpc for f, n in zip(firsts, sizes, strict=True)
        ):
            self.result.partial_last += 1
        del num_chunks

    def _record_jobs(self, meta: Any) -> None:
        bpc = self.cfg.blocks_per_chunk
        for job_id, job in meta.store_jobs.items():
            table = self.tables.get(job.req_id)
            if table is None:
                raise AssertionError(f"store job {job_id} of unknown request {job.req_id}")
            index = {b: k for k, b in enumerate(table)}
            seq = self.seqs[job.req_id]
            computed = self.computed.get(job.req_id, 0)
            pairs = []
            for gpu, chunk, sub, _first in vllm_chunk_mapping(
                job.src_spec, np.asarray(job.dst_spec.block_ids).tolist(), bpc
            ):
                k = index[gpu]  # block_indices name a group's first block only
                pos = np.arange(k * self.bs, (k + 1) * self.bs)
                known = pos < min(computed, len(seq.tokens))
                hashes = seq.hashes[np.minimum(pos, len(seq.hashes) - 1)]
                pairs.append((gpu, chunk, sub, hashes, known))
            self._coverage(job.src_spec, len(job.dst_spec.block_ids))
            self.store_jobs[job_id] = _StoreJob(job.req_id, pairs)
            self.result.stores += 1
        for job_id, job in meta.load_jobs.items():
            pairs = [
                (gpu, chunk, sub, k)
                for gpu, chunk, sub, k in vllm_chunk_mapping(
                    job.dst_spec, np.asarray(job.src_spec.block_ids).tolist(), bpc
                )
            ]
            self._coverage(job.dst_spec, len(job.src_spec.block_ids))
            sync = vllm_compat.load_is_sync(job)  # vLLM 0.26 has async loads only
            self.load_jobs[job_id] = _LoadJob(job.req_id, sync, pairs)
            if sync:
                self.result.loads_sync += 1
            else:
                self.result.loads_async += 1

    def _check_completed(self, completed: dict[int, int]) -> None:
        for job_id in completed:
            if job_id in self.store_jobs:
                self._check_store(job_id, self.store_jobs.pop(job_id))
            elif job_id in self.load_jobs:
                self._check_load(job_id, self.load_jobs.pop(job_id))
            else:
                self.result.note("harness", f"step {self.step}: unknown job {job_id} completed")

    def _check_store(self, job_id: int, job: _StoreJob) -> None:
        reader = self._cpu()
        self.result.stores_done += 1
        for gpu, chunk, sub, hashes, known in job.pairs:
            self.result.store_blocks_checked += 1
            bad = reader.bad(chunk, sub, hashes, known)
            if bad:
                self.result.store_bad_blocks += 1
                self.result.note(
                    "store",
                    f"step {self.step} job {job_id} ({job.req_id}): GPU block {gpu} -> CPU "
                    f"chunk {chunk} sub-block {sub}: {bad} of {int(known.sum())} slots wrong",
                )
            self.cpu_ideal[(chunk, sub)] = (hashes, known)

    def _check_load(self, job_id: int, job: _LoadJob) -> None:
        self.result.loads_done += 1
        if not job.sync:
            self.loaded_waiting[job.req_id] = [gpu for gpu, *_ in job.pairs]
        seq = self.seqs[job.req_id]
        phys = self._resolve_tables([[gpu for gpu, *_ in job.pairs]])[0]
        for (gpu, chunk, sub, k), p in zip(job.pairs, phys, strict=True):
            self.result.load_blocks_checked += 1
            stored = self.cpu_ideal.get((chunk, sub))
            if stored is None:
                self.result.note(
                    "harness",
                    f"step {self.step} load job {job_id}: CPU chunk "
                    f"{chunk} sub-block {sub} was never stored",
                )
                continue
            hashes, known = stored
            pos = np.arange(k * self.bs, (k + 1) * self.bs)
            own = seq.hashes[np.minimum(pos, len(seq.hashes) - 1)]
            if not np.array_equal(own[known], hashes[known]):
                self.result.note(
                    "harness",
                    f"step {self.step} load job {job_id}: vLLM loads "
                    f"chunk {chunk}/{sub} into block {k} of {job.req_id} but it "
                    "holds other tokens",
                )
            bad = self.kv.block_bad(int(p), hashes, known)
            if bad:
                self.result.load_bad_blocks += 1
                self.result.note(
                    "load",
                    f"step {self.step} job {job_id} ({job.req_id}, "
                    f"{'sync' if job.sync else 'async'}): CPU chunk {chunk} sub-block {sub} -> "
                    f"GPU block {gpu} (physical {p}, block {k} of the request): {bad} of "
                    f"{int(known.sum())} slots wrong",
                )
