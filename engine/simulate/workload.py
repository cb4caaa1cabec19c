"""The synthetic workload of ``kvmem simulate``: seeded requests for each scheduler worker.

A request is its arrival (a scheduler iteration), its whole token sequence (prompt, then
the output the "model" will produce, both fixed in advance so the K/V of every position
is known before it is computed), and whether it decodes with speculative drafts. A share
of the prompts start with one of a few system prompts common to every worker: those are
what the prefix cache shares across processes.

Everything is drawn from ``numpy.random.default_rng`` seeded by ``(seed, worker)`` (the
system prompts by ``seed`` alone), so the same seed and options give the same requests,
token for token, on every run and machine; :class:`WorkloadDigest` proves it (the report
shows it). No module of the server is imported: the simulator's workers are clients.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import numpy as np

VOCAB = 32000  # token ids are drawn from [1, VOCAB)
_LENGTH_SIGMA = 0.6  # spread of the lognormal prompt and output lengths


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What one worker's requests look like. Lengths are means of lognormal draws
    (at least 1 token), each request capped at ``max_len`` tokens in all (prompt and
    output): the server's context limit and a share of its pool, so one request always
    fits. ``arrival_rate``: mean arrivals per scheduler iteration (a Poisson process in
    iterations, not seconds, so the schedule does not depend on the machine's speed).
    ``requests``: per worker; None: endless (a run by duration).

    ``turns`` > 1: a multi-turn chat workload instead (:func:`conversations`): users
    whose conversations grow turn by turn on a shared system prompt; each request is one
    turn, its prompt the whole conversation so far."""

    seed: int = 0
    requests: int | None = 200
    arrival_rate: float = 0.3
    prompt_len: int = 192
    output_len: int = 96
    system_prompts: int = 4
    system_prompt_len: int = 512
    shared: float = 0.75
    spec: float = 0.25
    spec_k: int = 4
    accept: float = 0.7
    max_len: int = 8192
    turns: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the workload. ``tokens``: the whole sequence, prompt then output
    (``len(tokens) - prompt_len`` output tokens); ``system``: the index of the system
    prompt it starts with, or -1; ``spec_k``: drafts per decode step (0: none)."""

    index: int
    rid: str
    arrival: int
    tokens: np.ndarray
    prompt_len: int
    system: int
    spec_k: int
    turn: int = 0  # its conversation's turn (multi-turn workloads; else 0)

    @property
    def total_len(self) -> int:
        return int(self.tokens.size)


def system_prompts(spec: WorkloadSpec) -> list[np.ndarray]:
    """The system prompts every worker shares (drawn from the seed alone)."""
    rng = np.random.default_rng([spec.seed, 0x5157])
    prompts = []
    for _ in range(spec.system_prompts):
        n = max(1, round(spec.system_prompt_len * rng.uniform(0.5, 1.5)))
        prompts.append(rng.integers(1, VOCAB, size=n, dtype=np.int32))
    return prompts


def _lognormal(rng: np.random.Generator, mean: int) -> int:
    """A length with the given mean (lognormal, sigma ``_LENGTH_SIGMA``), at least 1."""
    mu = np.log(max(mean, 1)) - _LENGTH_SIGMA**2 / 2
    return max(1, round(float(rng.lognormal(mu, _LENGTH_SIGMA))))


def generate(spec: WorkloadSpec, worker: int) -> Iterator[SimRequest]:
    """Worker ``worker``'s requests in arrival order (endless when ``spec.requests`` is
    None). O(tokens) each: one vectorised draw of its user tokens and output."""
    if spec.turns > 1:
        yield from conversations(spec, worker)
        return
    shared = system_prompts(spec)
    rng = np.random.default_rng([spec.seed, worker + 1])
    arrival = 0.0
    index = 0
    while spec.requests is None or index < spec.requests:
        arrival += float(rng.exponential(1.0 / spec.arrival_rate)) if spec.arrival_rate > 0 else 0.0
        system = int(rng.integers(len(shared))) if shared and rng.random() < spec.shared else -1
        head = shared[system] if system >= 0 else np.zeros(0, dtype=np.int32)
        user = _lognormal(rng, spec.prompt_len)
        output = _lognormal(rng, spec.output_len)
        spec_k = spec.spec_k if rng.random() < spec.spec else 0
        body = rng.integers(1, VOCAB, size=user + output, dtype=np.int32)
        tokens = np.concatenate([head, body])[: spec.max_len]
        prompt_len = min(head.size + user, tokens.size - 1) if tokens.size > 1 else 1
        yield SimRequest(index, f"w{worker}-r{index}", int(arrival), tokens, prompt_len, system, spec_k)
        index += 1


def conversations(spec: WorkloadSpec, worker: int) -> Iterator[SimRequest]:
    """A multi-turn chat workload, the shape of SGLang's multi-turn benchmark: each user
    (``ceil(requests / turns)`` of them per worker, endless users for a run by duration)
    has a conversation on one of the shared system prompts, ``turns`` turns of a user
    message (``prompt_len`` tokens on average) and an answer (``output_len``); turn ``t``'s
    request is the conversation up to its answer, its prompt everything before the
    answer (so it starts with turn ``t - 1``'s whole request). Requests come turn by
    turn, the users interleaved (turn 1 of every user of a group of users, then turn 2,
    ...), so a user's history waits for all the others' turns between two of its own:
    on a pool smaller than all the histories it leaves the device between turns. A
    conversation stops at ``max_len`` tokens (its last turns are dropped). No drafts."""
    shared = system_prompts(spec) or [np.zeros(0, dtype=np.int32)]
    rng = np.random.default_rng([spec.seed, worker + 1, 0x7475])
    arrival = 0.0
    index = 0
    group = 16  # users interleaved at once; a run by duration takes group after group
    while spec.requests is None or index < spec.requests:
        users = group if spec.requests is None else min(group, -(-(spec.requests - index) // spec.turns))
        turns: list[list[tuple[np.ndarray, int, int]]] = []  # per user: (tokens, prompt_len, system) per turn
        for _ in range(users):
            system = int(rng.integers(len(shared)))
            conv = shared[system]
            mine: list[tuple[np.ndarray, int, int]] = []
            for _ in range(spec.turns):
                user = rng.integers(1, VOCAB, size=_lognormal(rng, spec.prompt_len), dtype=np.int32)
                answer = rng.integers(1, VOCAB, size=_lognormal(rng, spec.output_len), dtype=np.int32)
                prompt_len = conv.size + user.size
                conv = np.concatenate([conv, user, answer])
                if conv.size > spec.max_len:
                    break
                mine.append((conv, prompt_len, system))
            turns.append(mine)
        if not any(turns):  # max_len holds not even a first turn: nothing would ever come
            return
        for t in range(spec.turns):
            for u in range(users):
                if t >= len(turns[u]) or (spec.requests is not None and index >= spec.requests):
                    continue
                tokens, prompt_len, system = turns[u][t]
                arrival += float(rng.exponential(1.0 / spec.arrival_rate)) if spec.arrival_rate > 0 else 0.0
                yield SimRequest(index, f"w{worker}-r{index}", int(arrival), tokens, prompt_len, system, 0, t)
                index += 1


class WorkloadDigest:
    """A running SHA-256 of the requests a worker generated (arrival, prompt length,
    system prompt, drafts and every token id): equal digests, equal workloads."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.num_requests = 0

    def add(self, request: SimRequest) -> None:
        head = np.array([request.arrival, request.prompt_len, request.system, request.spec_k], dtype="<i8")
        self._hash.update(head.tobytes())
        self._hash.update(request.tokens.astype("<i4", copy=False).tobytes())
        self.num_requests += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def combined_digest(digests: list[str]) -> str:
    """One digest for the workers' digests, in worker order."""
    return hashlib.sha256(" ".join(digests).encode()).hexdigest()[:16]


class Acceptance:
    """How many of a request's drafts the "model" accepts at each speculative step: a
    run of independent draws, each accepted with probability ``p`` until the first
    rejection. Seeded per request, so a request's k-th draw is the same on every run."""

    __slots__ = ("_p", "_rng")

    def __init__(self, seed: int, worker: int, index: int, p: float) -> None:
        self._rng = np.random.default_rng([seed, worker + 1, index, 0xACC])
        self._p = p

    def draw(self, k: int) -> int:
        if k <= 0:
            return 0
        rejected = np.flatnonzero(self._rng.random(k) >= self._p)
        return int(rejected[0]) if rejected.size else k


def drafts(request: SimRequest, start: int, k: int, accepted: int) -> np.ndarray:
    """The ``k`` drafts the workload proposes after position ``start`` of ``request``:
    its own next ``accepted`` tokens (an :class:`Acceptance` draw), then others (each
    token + 1: another sequence, which a model sampling the request's tokens rejects)."""
    right = request.tokens[start + 1 : start + 1 + accepted]
    return np.concatenate([right, request.tokens[start + 1 + accepted : start + 1 + k] + 1])
