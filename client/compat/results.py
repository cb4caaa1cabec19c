"""What the drop-in (:mod:`kvmem.client.compat`) hands back inside an iteration block,
before the block's Step has gone out: lazily resolved results, and the request-indexed
view of the block table.

* :class:`KVLocResult`: an ``alloc``'s ``kv_loc``. At the end of the block it resolves
  to the int32 tensor (or to a failure); from then on torch functions accept it in
  place of the tensor (``torch.cat(results)``), and ``ok`` / ``bool(result)`` / ``value``
  say whether it succeeded (``value`` is the tensor or None, the reference's return).
* :class:`PendingInt`: a ``match_prefix`` (tokens matched) or ``cache_request`` (pages
  switched) result: ``int(result)`` once resolved.
* :class:`Iteration`: one block: its results, ``collect()`` (every OK ``kv_loc``
  concatenated in call order: one slice of the Step's answer, no per-item work).
* :class:`ReqToPage`: ``req_to_page[req]``, ``req_to_page[reqs_tensor]``,
  ``req_to_page[req, a:b]``: rows of the server's block table, request indices mapped to
  kvmem slots. No copy of the table: a gather of the rows asked for, O(rows).

Underneath, the results of one Step share a :class:`Ticket`: one assignment of the
answered Step (a :class:`StepView`) or of its error resolves them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvmem.client.step import AllocStatus

_NOT_YET = "is resolved at the end of the iteration block (its Step has not gone out yet)"


class StepView:
    """The allocs of one answered Step, shared by its results: the ``kv_loc`` of every
    item concatenated (a copy the caller may write to, on the allocator's device), the
    item offsets and the per-item status bytes."""

    __slots__ = ("kv_loc", "offsets", "status")

    def __init__(self, kv_loc: torch.Tensor, offsets: list[int], status: bytes) -> None:
        self.kv_loc = kv_loc
        self.offsets = offsets
        self.status = status

    def item(self, i: int) -> torch.Tensor:
        return self.kv_loc[self.offsets[i] : self.offsets[i + 1]]


class Ticket:
    """What the results of one block wait for: the answered Step (``view``), or why
    there is none (``error``). One assignment resolves every result of the block."""

    __slots__ = ("error", "view")

    def __init__(self) -> None:
        self.view: StepView | None = None
        self.error: BaseException | None = None


class KVLocResult:
    """The ``kv_loc`` of one ``alloc(req_pool_index, ...)`` made inside an iteration block.

    Until the block ends it holds nothing (reading it raises RuntimeError). Then:
    ``ok`` (also ``bool(result)``) says whether the alloc succeeded, ``status`` why not
    (an :class:`~kvmem.client.step.AllocStatus`: OUT_OF_PAGES, CONTEXT_TOO_LONG,
    QUOTA_EXCEEDED), ``value`` is the int32 tensor or None (the reference's return
    value), and the result stands for its tensor in torch functions (``torch.cat``,
    indexing, ``.long()``, ``len``...). A failed alloc changed nothing for its request;
    using its result as a tensor raises ValueError saying so. If the block's Step
    failed as a whole, reading the result raises that error.
    """

    __slots__ = {"_i": "", "_ticket": "", "req_pool_index": "The request index the alloc was made for."}

    def __init__(self, req_pool_index: int, ticket: Ticket, i: int) -> None:
        self.req_pool_index = req_pool_index
        self._ticket = ticket
        self._i = i  # the alloc item's position in the Step

    @property
    def _view(self) -> StepView | None:
        return self._ticket.view

    @property
    def _error(self) -> BaseException | None:
        return self._ticket.error

    @property
    def resolved(self) -> bool:
        """The block ended: the result is known (or its Step failed)."""
        return self._view is not None or self._error is not None

    def _checked(self) -> StepView:
        if self._view is None:
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"the kv_loc of request index {self.req_pool_index} {_NOT_YET}")
        return self._view

    @property
    def status(self) -> AllocStatus:
        """The alloc's :class:`~kvmem.client.step.AllocStatus` (OK, OUT_OF_PAGES, ...)."""
        view = self._checked()
        return AllocStatus(view.status[self._i])

    @property
    def ok(self) -> bool:
        """The alloc succeeded (``bool(result)`` says the same)."""
        view = self._checked()
        return view.status[self._i] == 0

    def __bool__(self) -> bool:
        return self.ok

    @property
    def value(self) -> torch.Tensor | None:
        """The int32 ``kv_loc`` tensor, or None if the alloc failed (as the reference returns)."""
        view = self._checked()
        return view.item(self._i) if view.status[self._i] == 0 else None

    def tensor(self) -> torch.Tensor:
        """The ``kv_loc`` tensor; ValueError if the alloc failed."""
        view = self._checked()
        if view.status[self._i] != 0:
            raise ValueError(
                f"the alloc of request index {self.req_pool_index} failed ({self.status.name}): it has no kv_loc "
                "(leave it out of the batch; check result.ok)"
            )
        return view.item(self._i)

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.cat and args and not kwargs and (len(args) == 1 or args[1] in (0, -1)):
            whole = _cat_of_a_block(args[0])
            if whole is not None:
                return whole
        return func(*_tensors(args), **{k: _tensors(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str) -> Any:  # the tensor's attributes: .long(), .shape, .to(...), .numel()
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tensor(), name)

    def __len__(self) -> int:
        return len(self.tensor())

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.tensor()[key]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensor())

    def __repr__(self) -> str:
        if not self.resolved:
            return f"KVLocResult(req_pool_index={self.req_pool_index}, pending)"
        if self._error is not None:
            return f"KVLocResult(req_pool_index={self.req_pool_index}, error={self._error!r})"
        if not self.ok:
            return f"KVLocResult(req_pool_index={self.req_pool_index}, {self.status.name})"
        return f"KVLocResult(req_pool_index={self.req_pool_index}, {self.tensor()!r})"


def _cat_of_a_block(items: Any) -> torch.Tensor | None:
    """``torch.cat`` of successful results of one block in call order, without gaps (the
    usual ``out_cache_loc``): one copy of their run of the Step's ``kv_loc`` instead of
    a view per item (which costs about a microsecond each). None when ``items`` is
    anything else: the general path then decides."""
    if not isinstance(items, (list, tuple)) or not items or type(items[0]) is not KVLocResult:
        return None
    ticket = items[0]._ticket
    view = ticket.view
    if view is None:
        return None
    start = items[0]._i
    end = start + len(items)
    if any(type(r) is not KVLocResult or r._ticket is not ticket for r in items):
        return None
    if [r._i for r in items] != list(range(start, end)) or view.status[start:end].count(0) != end - start:
        return None
    return view.kv_loc[view.offsets[start] : view.offsets[end]].clone()


def _tensors(value: Any) -> Any:
    """``value`` with every :class:`KVLocResult` in it (nested in lists, tuples) replaced
    by its tensor."""
    if isinstance(value, KVLocResult):
        return value.tensor()
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return value


class PendingInt:
    """An int known at the end of the iteration block: ``match_prefix``'s tokens matched,
    ``cache_request``'s pages switched. ``int(result)`` (or ``value``) once resolved."""

    __slots__ = {
        "_error": "",
        "_value": "",
        "what": "The call it answers, for messages (``match_prefix of request index 3``).",
    }

    def __init__(self, what: str) -> None:
        self.what = what
        self._value: int | None = None
        self._error: BaseException | None = None

    def _resolve(self, value: int) -> None:
        self._value = value

    def _fail(self, error: BaseException) -> None:
        self._error = error

    @property
    def resolved(self) -> bool:
        """The block ended: the value is known (or its Step failed)."""
        return self._value is not None or self._error is not None

    @property
    def value(self) -> int:
        """The int; RuntimeError before the block's end, its Step's error if that failed."""
        if self._value is None:
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"{self.what} {_NOT_YET}")
        return self._value

    def __int__(self) -> int:
        return self.value

    def __index__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return self.value == other if isinstance(other, int) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PendingInt({self.what}: {self._value if self.resolved else 'pending'})"


class Iteration:
    """One iteration block: the ``alloc`` results in call order; after the block,
    ``collect()`` and ``failed``. ``num_round_trips``: the calls its end made (the Open
    of requests seen for the first time, if any, and the Step). Made by the allocator
    (``ticket``: the block's Step, which its results wait for too)."""

    def __init__(self, ticket: Ticket | None = None) -> None:
        self.results: list[KVLocResult] = []
        self.num_round_trips = 0
        self.ended = False
        self._ticket = Ticket() if ticket is None else ticket

    def collect(self) -> torch.Tensor:
        """Every successful alloc's ``kv_loc`` concatenated in call order (failed allocs
        hold no tokens): the scheduler's ``out_cache_loc``. One view of the Step's
        answer, no per-item work."""
        if not self.ended:
            raise RuntimeError(f"collect() {_NOT_YET}")
        view = self._ticket.view
        if view is None:
            return torch.empty(0, dtype=torch.int32)
        return view.kv_loc

    @property
    def failed(self) -> list[KVLocResult]:
        """The allocs that failed (each changed nothing for its request)."""
        return [r for r in self.results if not r.ok]


class ReqToPage:
    """The block table as the reference's ``req_to_page``: indexed by request index.

    ``table()`` returns the mapped table (rows by kvmem slot); ``slot_of`` maps request
    index -> slot (0 for an index with no kvmem request: the padding row, all zeros).
    ``cpu``: results are moved to the host (the reference's ``req_to_page_cpu``).
    Rows are read-only views or gathers of the server's table: a page past a request's
    length is 0 (the reference leaves stale ids there)."""

    def __init__(self, table: Callable[[], torch.Tensor], slot_of: torch.Tensor, cpu: bool = False) -> None:
        self._table = table
        self._slot_of = slot_of
        self._cpu = cpu

    @property
    def shape(self) -> torch.Size:
        """(request indices, pages per row): the reference's ``req_to_page.shape``."""
        return torch.Size((self._slot_of.numel(), self._table().shape[1]))

    def _slots(self, rows: Any, table: torch.Tensor) -> Any:
        if isinstance(rows, int):
            n = self._slot_of.numel()
            if not -n <= rows < n:
                raise IndexError(f"request index {rows} out of range [0, {n})")
            return int(self._slot_of[rows])
        if isinstance(rows, slice):
            return self._slot_of[rows].to(table.device)
        index = torch.as_tensor(rows)
        if index.dtype == torch.bool:
            return self._slot_of[index.cpu()].to(table.device)
        return self._slot_of[index.cpu().long()].to(table.device)

    def __getitem__(self, key: Any) -> torch.Tensor:
        table = self._table()
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        out = table[(self._slots(rows, table), *rest)]
        return out.cpu() if self._cpu else out

    def __len__(self) -> int:
        return self._slot_of.numel()

    def __repr__(self) -> str:
        return f"ReqToPage(shape={tuple(self.shape)}, {'cpu' if self._cpu else 'device'})"
