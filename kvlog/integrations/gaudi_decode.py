"""The HPU runner's decode inputs, resolved in one lookup a step (part of the Gaudi switch).

vllm-gaudi's ``HPUModelRunner._create_decode_input_data(num_decodes, num_scheduled_tokens,
context_lens, block_table_cpu_tensor, ...)`` turns the input batch's block-table tensor
(logical ids, one row per decode) into the decode's attention buffers, and resolves logical
ids to physical ones as it goes, through the defragmenter:

- every decode's table, as lists (``self._resolve_all_blocks(block_tables_list)``);
- every decode token's slot block, one id at a time
  (``block_number.apply_(self._resolve_block)``).

At serving scale (256 decodes of ~30 blocks) that is ~8,000 ids through Python lists and a
few hundred Python calls a step, a quarter of kvlog's step cost. The switch wraps the method:
the rows and columns it reads (``[:num_decodes, :ceil(max(context_len + tokens) /
attn_block_size)]``) are resolved in one compiled pass
(:meth:`~kvlog.integrations.defragmenter.OnlineDefragmenter.resolve_table`) into a new
tensor, the original method runs on that tensor, and for that call only the runner's
``_resolve_block`` and ``_resolve_all_blocks`` hand ids through unchanged. The input batch's
own tensor is never written.

Why the method's results are the same: nothing inside it changes the books, so an id
resolved at its start is the id it would have resolved later; every id it resolves comes
from those rows and columns, except the padding rows' slot blocks, which it overwrites with
dummy slots right after (and whose ``_PAD_BLOCK_ID`` is ``num_blocks``, outside the pool,
so that its resolve is the id itself anyway). A test runs the real
method, taken out of vllm-gaudi's source, both ways and compares every buffer.

Anything unexpected leaves the runner's own path in charge: another defragmenter than
kvlog's, a method with another signature (checked when patching), no ``attn_block_size``, a
table that is not a 2-D CPU tensor, an instance that overrides a resolver itself.

The override is the instance's, for the call's duration (restored on any exception): the
runner builds a step's inputs on one thread, and nothing else resolves on that runner
while it does.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvlog.integrations.defragmenter import OnlineDefragmenter

__all__ = [
    "DECODE_HOOK",
    "PARAMETERS",
    "RESOLVERS",
    "decode_columns",
    "patch_decode_inputs",
    "resolve_decode_rows",
]

DECODE_HOOK = "_create_decode_input_data"
PARAMETERS = (
    "self", "num_decodes", "num_scheduled_tokens", "context_lens", "block_table_cpu_tensor"
)  # fmt: skip
"""The hook's leading parameters, as the wrapper reads them (checked before patching)."""
RESOLVERS = ("_resolve_block", "_resolve_all_blocks")
"""The runner's resolvers the hook calls; for one wrapped call, each hands ids through."""
_PATCHED = "__kvlog_decode__"
_log = logging.getLogger(__name__)


def decode_columns(context_lens: Any, num_scheduled_tokens: Sequence[int], block_size: int) -> int:
    """How many leading columns of the decodes' rows the hook resolves: enough for every
    decode's blocks up to its last scheduled token (its table, ``ceil((context_len + 1) /
    block_size)`` blocks, and its tokens' slot blocks, ``(context_len + j) // block_size``
    for ``j`` below its token count), from the longest context and the most tokens: two
    reductions, no per-decode arithmetic (more than the exact need only where those are
    two decodes' and their sum crosses a block)."""
    if not len(num_scheduled_tokens):
        return 0
    longest = int(np.maximum.reduce(context_lens)) + max(num_scheduled_tokens)
    return -(-longest // block_size)


def resolve_decode_rows(
    defragmenter: OnlineDefragmenter,
    num_decodes: int,
    num_scheduled_tokens: Sequence[int],
    context_lens: Any,
    block_table_cpu_tensor: Any,
    block_size: int,
) -> Any:
    """What the hook hands the method for its table: the decodes' rows of the runner's
    block-table tensor, over the columns it reads (:func:`decode_columns`, at most the
    tensor's width: a table narrower than a decode needs fails in the method either way),
    resolved into a new tensor in one ``resolve_table``."""
    tokens = num_scheduled_tokens[:num_decodes]
    columns = decode_columns(context_lens[:num_decodes], tokens, block_size)
    return defragmenter.resolve_table(block_table_cpu_tensor, num_decodes, columns)


def _as_is(block_tables: Any) -> Any:
    return block_tables


def _resolved_table(runner: Any, args: tuple[Any, ...]) -> Any | None:
    """The decodes' rows of the hook's table, resolved; None where the runner's own path
    must run (see the module's docstring)."""
    defragmenter = getattr(runner, "defragmenter", None)
    block_size = getattr(runner, "attn_block_size", None)
    num_decodes, num_scheduled_tokens, context_lens, table = args[:4]
    if (
        not isinstance(defragmenter, OnlineDefragmenter)
        or not isinstance(block_size, int)
        or block_size <= 0
        or any(name in vars(runner) for name in RESOLVERS)
        or not isinstance(num_decodes, int)
        or num_decodes <= 0
        or not isinstance(table, torch.Tensor)
        or not table.is_cpu
        or table.ndim != 2
        or table.shape[0] < num_decodes
        or len(num_scheduled_tokens) < num_decodes
    ):
        return None
    return resolve_decode_rows(
        defragmenter, num_decodes, num_scheduled_tokens, context_lens, table, block_size
    )


def _decode_hook(raw: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(raw)
    def create_decode_input_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        resolved = _resolved_table(self, args) if len(args) >= 4 else None
        if resolved is None:
            return raw(self, *args, **kwargs)
        self._resolve_block = int  # an int in, the same int out: a C call an id
        self._resolve_all_blocks = _as_is
        try:
            return raw(self, *args[:3], resolved, *args[4:], **kwargs)
        finally:
            del self._resolve_block, self._resolve_all_blocks

    setattr(create_decode_input_data, _PATCHED, raw)
    return create_decode_input_data


def _fits(owner: type) -> bool:
    """Whether ``owner``'s hook takes the parameters the wrapper reads, and the owner has
    the two resolvers the hook calls."""
    try:
        names = tuple(inspect.signature(vars(owner)[DECODE_HOOK]).parameters)
    except (TypeError, ValueError):
        return False
    return names[: len(PARAMETERS)] == PARAMETERS and all(hasattr(owner, n) for n in RESOLVERS)


def patch_decode_inputs(module: types.ModuleType) -> list[str]:
    """Wrap every class in ``module`` that defines the hook; the names patched (a class
    whose hook does not fit is left as it is, with a warning)."""
    patched: list[str] = []
    for owner in list(vars(module).values()):
        if not (isinstance(owner, type) and DECODE_HOOK in vars(owner)):
            continue
        if hasattr(vars(owner)[DECODE_HOOK], _PATCHED):
            continue  # patched already (the class is imported by another patched module)
        if not _fits(owner):
            _log.warning(
                "kvlog: %s.%s.%s does not take %s; its decode tables are resolved id by id",
                module.__name__, owner.__name__, DECODE_HOOK, ", ".join(PARAMETERS[1:]),
            )  # fmt: skip
            continue
        setattr(owner, DECODE_HOOK, _decode_hook(vars(owner)[DECODE_HOOK]))
        patched.append(f"{module.__name__}.{owner.__name__}.{DECODE_HOOK}")
    return patched
