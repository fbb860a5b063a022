"""What a recorded run did and what another policy would have done: the run's figures
(``tally``), the cost model (``cost``), canary bytes (``canary``), replay and its verification
(``replay``), the segment-parallel replay (``parallel``), what-if grids (``grid``) on a Ray pool
(``pool``), the policy fields' names and parsing (``policy``), and the ranks' agreement
(``ranks``)."""

from __future__ import annotations

__all__: list[str] = []
