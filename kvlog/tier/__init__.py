"""The CPU tier: recording what vLLM's offloading manager is asked, replaying it exactly
(``reducers/cpu_tier.py``), and asking what other capacities and policies would have done.

- :mod:`kvlog.tier.record`: ``TierRecorder`` wraps the scheduler side's manager.
- :mod:`kvlog.tier.replay`: ``replay_tier`` refolds a log's tier events and compares answers.
- :mod:`kvlog.tier.trace`: a log (or a public trace) as the requests' key sequences.
- :mod:`kvlog.tier.whatif`: one variant (capacity, eviction, threshold) on a trace.
- :mod:`kvlog.tier.optimum`: the offline optimum and one-pass hit-rate curves.
"""

__all__: list[str] = []
