"""A ``kvmem generate`` worker process, and what it shares with the command: the
prompts (``--prompts FILE.jsonl`` or the built-in chat set), the model's loading and its
config.

A worker (:func:`worker_main`, started with multiprocessing's spawn by
:mod:`.command`) loads the model, attaches an
:class:`~kvmem.engine.generate.Engine` to the server (its geometry checked), waits for the
``go`` event, completes its share of the prompts greedily and, unless told not to,
computes each one's reference with the same model's own ``generate(do_sample=False)``
(transformers' attention and cache). Its messages, dicts with a ``kind``:

* ``ready``: loaded and attached; ``progress``: tokens sampled and computed so far and
  the seconds since ``go`` (from a forward hook, at most every ``REPORT_S``);
  ``checking``: the last figures, the references being computed;
* ``done``: the completions, the run's figures, the seconds, the references (or None);
* ``error``: one line (a missing model, a refused geometry, a failure and its traceback).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import traceback
from collections.abc import Sequence
from typing import Any

from ..process import Flag, Messages
from .geometry import model_config as model_config  # moved there (no torch); bench/engine_bench.py imports it here

REPORT_S = 0.25
SYSTEM_PROMPTS = (
    "You are a concise, friendly assistant. Answer the question in one or two short sentences, plainly and "
    "accurately, without lists or headings. If you are not sure, say so briefly.",
    "You are a patient teacher who explains things simply to a curious twelve-year-old. Give the key idea "
    "first, then one everyday example, in a few short sentences.",
)
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "What does a compiler do?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Why do we have seasons?",
    "What is a prime number?",
)


FOLLOW_UPS = (
    "Can you explain that a little more?",
    "Give one concrete example.",
    "Say it again in at most ten words.",
    "Why does that matter?",
    "What do people often get wrong about it?",
)


WORDS = (
    "river", "market", "winter", "signal", "garden", "engine", "letter", "harbor", "forest", "window", "silver",
    "morning", "station", "paper", "bridge", "music", "island", "number", "people", "valley", "doctor", "theory",
    "machine", "village", "answer", "season", "mountain", "canal", "library", "weather", "teacher", "record",
    "circle", "pocket", "orange", "ladder", "planet", "story", "factory", "kitchen", "lantern", "copper", "shadow",
    "meadow", "rocket", "engineer", "harvest", "journey", "cabinet", "sailor", "painter", "pattern", "travel",
    "measure", "follow", "build", "carry", "gather", "notice", "repair", "open", "close", "watch", "listen",
    "wander", "count", "carve", "borrow", "remember", "explain", "quiet", "bright", "early", "heavy", "gentle",
    "narrow", "careful", "ancient", "simple", "golden", "distant", "sudden", "steady", "hollow", "under", "across",
    "beyond", "between", "during", "after", "before", "around", "through", "against", "toward",
)  # fmt: skip


def document(d: int, words: int = 220) -> str:
    """Document ``d``: ``words`` seeded words in sentences of 6 to 14 (220 words: about
    250 tokens for SmolLM2), the same text for the same ``d`` everywhere (a long input
    of its own for a multi-turn conversation, ``--document-words``; bench/store_bench.py's
    documents)."""
    rng = random.Random(1000 + d)
    out, n = [], 0
    while n < words:
        k = min(rng.randint(6, 14), words - n)
        sentence = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    return f"Document {d + 1}.\n" + " ".join(out)


class PromptError(ValueError):
    """A prompts file that cannot be read; the message names the file and line."""


class LoadError(RuntimeError):
    """The model could not be loaded: one line."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: exactly one of ``text``, ``messages`` (a chat) or ``token_ids``."""

    index: int
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    turn: int = 0  # a multi-turn conversation's turn (0: its first, or a single prompt)
    user: int = 0  # its conversation

    def describe(self, width: int = 48) -> str:
        """A short, one-line view of the prompt."""
        if self.turn:
            return _cut(f"user {self.user}, turn {self.turn + 1}: {self.question}", width)
        if self.token_ids is not None:
            shown = f"token ids {self.token_ids[:8]}{'...' if len(self.token_ids) > 8 else ''}"
        elif self.messages is not None:
            shown = str(self.messages[-1].get("content", ""))
        else:
            shown = str(self.text)
        return _cut(shown, width)

    @property
    def question(self) -> str:
        """A chat's last message (a multi-turn conversation's question of this turn)."""
        return str((self.messages or [{}])[-1].get("content", ""))

    def estimated_tokens(self) -> int:
        """An upper estimate of its tokens, before a tokenizer (for sizing a pool)."""
        if self.token_ids is not None:
            return len(self.token_ids)
        chars = sum(len(m.get("content", "")) for m in self.messages or ()) + len(self.text or "")
        return chars // 2 + 32 * (len(self.messages or ()) + 1)


def _cut(text: str, width: int) -> str:
    shown = " ".join(text.split())
    return shown if len(shown) <= width else shown[: width - 3] + "..."


def multi_turn_prompts(users: int, turns: int, document_words: int = 0) -> list[Prompt]:
    """``users`` conversations of ``turns`` turns each, turn-major (``index = turn * users
    + user``): a user's first turn is a system prompt (one of two, shared) and a question
    of its own (after a document of ``document_words`` words of its own, when not 0: a
    long input, each later turn asking about it again); each later turn appends the last
    completion and a follow-up question, so a turn's prompt is the whole conversation so
    far. Only the first turn's tokens are known ahead; the worker builds the others from
    what the model answered."""
    out: list[Prompt] = []
    for turn in range(turns):
        for user in range(users):
            if turn == 0:
                asked = QUESTIONS[user % len(QUESTIONS)]
                question = f"I am user {user}. {asked}"
                if document_words:
                    doc = document(user, document_words)
                    question = f"I am user {user}. Read my document.\n\n{doc}\n\nQuestion: {asked}"
            else:
                question = FOLLOW_UPS[(user + turn - 1) % len(FOLLOW_UPS)]
            chat = [{"role": "system", "content": SYSTEM_PROMPTS[user % 2]}, {"role": "user", "content": question}]
            out.append(Prompt(turn * users + user, messages=chat, turn=turn, user=user))
    return out


def follow_up_ids(tokenizer: Any, question: str) -> list[int]:
    """The tokens a follow-up ``question`` adds after an answer: the chat template's
    rendering between an assistant message and the next generation prompt (the answer's
    end marker, the user turn, the assistant's start), or, for a tokenizer without a chat
    template, the question on a line of its own."""
    if getattr(tokenizer, "chat_template", None):
        marker = "\ue000"
        chat = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": marker},
            {"role": "user", "content": question},
        ]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        tail = text.split(marker, 1)[1]
        return list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    return list(tokenizer(f"\n{question}\n", add_special_tokens=False)["input_ids"])


def builtin_prompts() -> list[Prompt]:
    """Eight short chat prompts, each after one of two system prompts (A A B B A A B B:
    dealt round-robin, every worker gets both, so requests match each other's cached
    pages across workers)."""
    return [
        Prompt(i, messages=[{"role": "system", "content": SYSTEM_PROMPTS[i // 2 % 2]}, {"role": "user", "content": q}])
        for i, q in enumerate(QUESTIONS)
    ]


def read_prompts(path: str) -> list[Prompt]:
    """One JSON object a line: ``{"prompt": TEXT}``, ``{"messages": [{"role": ..., "content":
    ...}, ...]}`` or ``{"token_ids": [...]}``; blank lines are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise PromptError(f"cannot read --prompts {path}: {err.strerror}") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptError(f"{where}: not JSON ({err.msg})") from None
        keys = sorted(set(item) & {"prompt", "messages", "token_ids"}) if isinstance(item, dict) else []
        if len(keys) != 1:
            raise PromptError(f'{where}: needs exactly one of "prompt", "messages" or "token_ids", got {line[:80]}')
        value = item[keys[0]]
        index = len(prompts)
        if keys[0] == "prompt" and isinstance(value, str) and value:
            prompts.append(Prompt(index, text=value))
        elif keys[0] == "messages" and _is_chat(value):
            prompts.append(Prompt(index, messages=value))
        elif keys[0] == "token_ids" and isinstance(value, list) and value and all(_is_id(t) for t in value):
            prompts.append(Prompt(index, token_ids=value))
        else:
            raise PromptError(
                f'{where}: "{keys[0]}" must be a non-empty '
                + {"prompt": "string", "messages": "list of {role, content}", "token_ids": "list of ints >= 0"}[keys[0]]
                + f", got {json.dumps(value)[:80]}"
            )
    if not prompts:
        raise PromptError(f"--prompts {path} holds no prompt")
    return prompts


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_model(model: str | None) -> tuple[Any, Any]:
    """The model (fp32, eval) and its tokenizer (or None) for ``--model``."""
    import torch

    from .models import load

    loaded, tokenizer = load(model, dtype=torch.float32)
    return loaded.eval(), tokenizer


def encode(prompt: Prompt, tokenizer: Any, model: str | None) -> list[int]:
    """The prompt's token ids (a chat through the tokenizer's chat template)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if tokenizer is None:
        raise PromptError(
            f"prompt {prompt.index} is text but the model at {model} has no tokenizer: give --prompts FILE.jsonl "
            'with {"token_ids": [...]} lines'
        )
    if prompt.messages is not None:
        if not getattr(tokenizer, "chat_template", None):  # a plain tokenizer: the messages as lines
            return list(tokenizer("\n".join(m["content"] for m in prompt.messages) + "\n")["input_ids"])
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.text)["input_ids"])


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateConfig:
    """One worker's run: its ``prompts`` (with their indices), the server, the model."""

    worker: int
    target: str
    auth_token: str | None
    model: str | None
    prompts: Sequence[Prompt]
    max_new_tokens: int
    token_budget: int
    max_running: int
    check: bool
    session: str
    namespace: str
    api: str = "client"
    speculate: int = 0
    corrupt: bool = False  # test hook: the first completion's last token is reported off by one
    role: str = "mixed"  # mixed, prefill or decode (see .moves)
    drain_after: int = 0  # test hook: SIGTERM itself once it has generated this many tokens (0: never)
    turns: int = 1  # > 1: its prompts are conversations of this many turns, turn-major (multi_turn_prompts)
    load_wait: str = "layer"  # how a request whose prefix is loading from the host tier waits (Engine)
    model_id: str = ""  # the model with its weights' revision (a server with a store keys its pages by it)
    fetch_wait_ms: float = 0.0  # how long a request whose prefix the server fetches from its store is held


def worker_main(
    config: GenerateConfig, messages: Messages, go: Flag, check: Flag, inbox: Any = None, acks: Any = None
) -> None:
    """A worker process's entry (see the module's docstring); ``check``: set once every
    worker has generated, so no worker's check runs beside another's timed generation;
    ``inbox`` and ``acks``: its queues of the hand-off protocol (:mod:`.moves`;
    None: it moves nothing)."""
    w = config.worker
    try:
        _work(config, messages, go, check, inbox, acks)
    except Exception as err:
        from kvmem.client.errors import KVMemError

        from .geometry import GeometryMismatch

        if isinstance(err, GeometryMismatch | PromptError | LoadError | KVMemError):
            message = str(err)
        else:
            message = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        messages.put({"kind": "error", "worker": w, "message": message})


def _work(config: GenerateConfig, messages: Messages, go: Flag, check: Flag, inbox: Any, acks: Any) -> None:
    import signal

    import torch

    from .attention import ATTENTION
    from .engine import Delta, Engine, stop_tokens
    from .moves import WorkerMoves

    w = config.worker
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    try:
        model, tokenizer = load_model(config.model)
    except (ImportError, OSError, RuntimeError, ValueError) as err:
        what = config.model or "(the bundled SmolLM2)"
        raise LoadError(f"cannot load --model {what}: {' '.join(str(err).split())}") from None
    attention = model.config._attn_implementation
    turns = config.turns
    users = len(config.prompts) // turns
    if turns > 1 and tokenizer is None:
        raise PromptError("a multi-turn workload needs the model's tokenizer (the follow-up questions are text)")
    # The first turn's tokens; a later turn's are built from the answers (see below).
    ids = [encode(p, tokenizer, config.model) for p in config.prompts[:users]]
    stops = stop_tokens(model, tokenizer)
    counts = {"generated": 0, "computed": 0, "forwards": 0, "finished": 0}
    started = last = 0.0

    def on_forward(_module: Any, _args: Any, kwargs: dict[str, Any], _out: Any) -> None:
        nonlocal last
        counts["computed"] += int(kwargs["input_ids"].shape[1])
        counts["forwards"] += 1
        now = time.monotonic()
        if now - last >= REPORT_S:
            last = now
            messages.put({"kind": "progress", "worker": w, **counts, "elapsed_s": now - started})

    def took(delta: Delta) -> None:  # the tokens kept (a rejected draft is computed, not generated)
        counts["generated"] += len(delta.token_ids)
        counts["finished"] += delta.finish_reason is not None
        if config.drain_after and counts["generated"] >= config.drain_after and not counts.get("drained"):
            counts["drained"] = 1
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal: the handler drains

    moves = None
    if inbox is not None or acks is not None:
        moves = WorkerMoves(w, config.role, messages, inbox, acks)

    with Engine(
        model,
        config.target,
        tokenizer=tokenizer,
        name=config.session,
        cache_namespace=config.namespace,
        auth_token=config.auth_token,
        max_running=config.max_running,
        api=config.api,
        load_wait=config.load_wait,
        model_id=config.model_id,
        fetch_wait_ms=config.fetch_wait_ms,
    ) as engine:
        messages.put({"kind": "ready", "worker": w})
        go.wait()
        hook = model.register_forward_hook(on_forward, with_kwargs=True)
        started = time.monotonic()
        try:
            out: list[Any] = []
            asked: list[list[int]] = []  # every request's prompt tokens, in the order of config.prompts
            for turn in range(turns):  # one round per turn: its prompts are the conversations so far
                chunk = config.prompts[turn * users : (turn + 1) * users]
                if turn:
                    ids = [
                        [*prompt, *_answer(c.token_ids, stops), *follow_up_ids(tokenizer, p.question)]
                        for prompt, c, p in zip(asked[-users:], out[-users:], chunk, strict=True)
                    ]
                asked += ids
                out += engine.generate(
                    ids,
                    max_new_tokens=config.max_new_tokens,
                    stop_token_ids=stops,
                    token_budget=config.token_budget,
                    speculate=config.speculate,
                    on_delta=took,
                    moves=None if moves is None else moves.moves,
                    started_at=time.monotonic() if turn else started,  # a turn's TTFT counts from its round
                    indices=[p.index for p in chunk],
                )
            elapsed = time.monotonic() - started
            if moves is not None:
                moves.finish()  # its tickets adopted before its session ends
        finally:
            hook.remove()
        figures = dataclasses.asdict(engine.figures)
        if moves is not None:
            figures.update(
                handed_off=moves.moves.num_given, adopted=moves.moves.num_adopted, drained=moves.moves.draining
            )
    references = None
    if config.check:
        messages.put({"kind": "checking", "worker": w, **counts, "elapsed_s": elapsed})
        check.wait()
        model.set_attn_implementation(attention if attention != ATTENTION else "sdpa")
        references = [_reference(model, p, config.max_new_tokens, stops) for p in asked]
    described = {p.index: p.describe() for p in config.prompts}
    if moves is None:
        completions = [{**dataclasses.asdict(c), "index": p.index} for c, p in zip(out, config.prompts, strict=True)]
    else:  # the requests that finished here (theirs or adopted), by their indices among all prompts
        completions = [dataclasses.asdict(c) for c in out]
    turn_of = {p.index: p.turn for p in config.prompts}
    for c in completions:
        c.pop("logits", None)
        c["prompt"] = described.get(c["index"], "")
        c["turn"] = turn_of.get(c["index"], 0)
    if config.corrupt:
        ids_out = completions[0]["token_ids"]
        ids_out[-1] = (ids_out[-1] + 1) % int(model.config.vocab_size)
    messages.put(
        {
            "kind": "done",
            "worker": w,
            **counts,
            "elapsed_s": elapsed,
            "figures": figures,
            "completions": completions,
            "references": references,
        },
    )


def _answer(token_ids: list[int], stops: list[int]) -> list[int]:
    """A completion as the next turn's prompt carries it: without its stop token (the
    follow-up's tokens end the answer as the chat template does)."""
    return token_ids[:-1] if token_ids and token_ids[-1] in stops else token_ids


def _reference(model: Any, prompt: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
    """The model's own greedy ``generate()`` after ``prompt``, with the same stop tokens."""
    import torch

    ids = torch.tensor(prompt, dtype=torch.int64)[None]
    extra: dict[str, Any] = {"eos_token_id": stops, "pad_token_id": stops[0]} if stops else {}
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **extra
        )
    return list(out[0, ids.shape[1] :].tolist())
