"""vllm-gaudi's runner under vLLM's real scheduler and offloading connector (the harness's
``runner_output="gaudi"``): the connector's worker metadata dropped on forward steps, as
``HPUModelRunner.sample_tokens`` builds its ``KVConnectorOutput``.

Without kvlog's Gaudi switch vLLM's offloading fails: every store and load completion rides
the worker metadata, so the scheduler hears of them only on steps with nothing scheduled,
and asserts (``any_job.is_store or any_job.is_sync_load``) once a request whose load it still
counts pending gets a store; with the switch (``gaudi+switch``: the runner module patched by
``kvlog.integrations.gaudi.install``) the same configuration is clean. Runs in the vLLM
virtualenv only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the vLLM stage runs this module")

from tests import vllm_harness as harness

VLLM_ASSERT = "AssertionError"


def _failed_as_vllm_does(res: harness.RunResult) -> bool:
    """vLLM's scheduler assert, or wrong bytes loaded (with vLLM's own worker too)."""
    if any(VLLM_ASSERT in e and "_build_store_jobs" in e for e in res.errors):
        return True
    return not res.ok and res.load_bad_blocks > 0


@pytest.mark.parametrize("name", harness.GAUDI_RUNNER_CI, ids=str)
def test_the_gaudi_runner_needs_the_switch(name: str, tmp_path: Path) -> None:
    switched = harness.CONFIGS[name]
    plain = harness.CONFIGS[harness.without_switch(name)]
    res = harness.run_config(plain, str(tmp_path))
    assert _failed_as_vllm_does(res), res.summary()
    assert res.completions_forward == 0  # the runner hands no completion over on a forward
    res = harness.run_config(switched, str(tmp_path))
    assert res.ok, res.summary()
    assert res.completions_forward > 0 and res.stores_done > 0 and res.loads_done > 0
    assert res.replay_ok is True and res.tier is not None and res.tier.exact
