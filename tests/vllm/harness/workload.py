"""The workload and its canaries: requests from shared prefixes, and the bytes of every token
position as a function of the tokens up to it (identical prefixes, identical bytes)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvlog.synth.vllm_stubs import VOCAB
from kvlog.util.splitmix import mix64, mix64_array
from tests.vllm.harness.configs import CANARY_SALTS, M64, RunConfig


def canary(hashes: np.ndarray, tensor: int, heads: int, head_size: int) -> np.ndarray:
    """int16 values ``(n, heads, head_size)`` of the slots whose token-prefix hashes are given."""
    n = len(hashes)
    words = heads * head_size // 4
    salt = mix64_array(CANARY_SALTS[tensor % 4] + np.arange(words, dtype=np.uint64) * np.uint64(7))
    with np.errstate(over="ignore"):
        mixed = mix64_array(hashes.astype(np.uint64)[:, None] ^ salt[None, :])
    return mixed.view(np.int16).reshape(n, heads, head_size)


@dataclass
class Sequence_:
    """A request's whole token sequence (prompt then outputs) and the prefix hash per position."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int]
    hashes: np.ndarray


def make_sequence(req_id: str, prompt: list[int], max_tokens: int) -> Sequence_:
    """Outputs are a function of the prefix, so a re-sent prompt samples the same tokens."""
    tokens: list[int] = []
    hashes: list[int] = []
    h = 0x6A09E667F3BCC909
    for p in range(len(prompt) + max_tokens):
        tok = prompt[p] if p < len(prompt) else 1 + h % (VOCAB - 2)
        tokens.append(tok)
        h = mix64(h ^ ((tok * 0x9E3779B97F4A7C15) & M64))
        hashes.append(h)
    return Sequence_(req_id, list(prompt), max_tokens, tokens, np.array(hashes, dtype=np.uint64))


def make_workload(cfg: RunConfig) -> list[Sequence_]:
    """Prompts from a few shared prefixes plus unique suffixes; about a third are re-sent
    copies of an earlier prompt, late enough that vLLM has evicted its GPU blocks."""
    rng = random.Random(cfg.seed)
    prefixes = [
        [rng.randrange(2, VOCAB - 1) for _ in range(rng.randrange(32, 97))] for _ in range(4)
    ]
    prompts: list[tuple[list[int], int]] = []
    for i in range(cfg.num_requests):
        if i >= 30 and rng.random() < 0.35:
            prompt, max_tokens = prompts[rng.randrange(0, i - 20)]
            prompts.append((prompt, max_tokens))
            continue
        head = rng.choice(prefixes) if rng.random() < 0.75 else []
        suffix = [rng.randrange(2, VOCAB - 1) for _ in range(rng.randrange(8, 120))]
        prompts.append((head + suffix, rng.randrange(8, cfg.max_output)))
    return [make_sequence(f"req-{i}", p, m) for i, (p, m) in enumerate(prompts)]
