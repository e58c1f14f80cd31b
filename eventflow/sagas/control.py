"""Where a saga is, typed: its control state, saved beside its fields after every input.

- ``status`` (:class:`Status`): what ``sagas list`` shows.
- ``phase`` (:class:`Phase`): going ``forward`` (steps in definition order), ``compensating``
  (compensations of the steps done, newest first) or ``ended``.
- ``at``: the name of the step the saga is at (the one it waits on, backs off on, failed
  at, or finished last). Steps are identified by name, never by position, so a saga
  resumes at its step after a deploy that adds, removes or reorders others: what comes
  next is the first step after ``at`` in the definition then running that is not done.
- ``waiting`` (:class:`Waiting`): the one thing the saga waits for: a step's reply, a
  compensation's reply, or the backoff before a step past the pivot is sent again.
- ``timers`` (:class:`Timer`, by :func:`timer_key`): a step's deadline, a backoff and the
  saga's named timers, each with the token of its setting: a firing with another token
  was cancelled or rescheduled, and changes nothing. A saga waits for one thing at a
  time, so its deadline or backoff is one timer row (:data:`WAIT_ROW`), moved from step
  to step by one write.
- ``issued`` (:class:`Issued`): every command sent, with its step, action and attempt.
- ``kept`` (:class:`Kept`): inputs that reached the saga before its start (status
  ``pending``), applied right after it in arrival order.
- ``resume`` (:class:`Resume`): what ``sagas retry`` and ``sagas skip`` act on.

The JSON form (``as_dict``) carries ``"v": 2``. A control without it was written by the
first saga release (kind strings, ``undo:`` keys, a step index): :meth:`Control.from_dict`
reads it once into this form; its ``next_step`` index is dropped (the step a saga waits on
or failed at names where it is).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENDED",
    "STATUSES",
    "WAIT_ROW",
    "Action",
    "Control",
    "Issued",
    "Kept",
    "Phase",
    "Resume",
    "Status",
    "Timer",
    "TimerKind",
    "Wait",
    "Waiting",
    "timer_key",
    "timer_row",
]

_VERSION = 2

WAIT_ROW = "step:"
"""The timer row of the one deadline or backoff a saga waits on (a named timer cannot be
called so: ``on_timer`` refuses names starting with ``step:``)."""


class Status(enum.StrEnum):
    """A saga's status (DESIGN 5)."""

    PENDING = "pending"
    """Inputs kept, no start yet."""
    RUNNING = "running"
    COMPLETED = "completed"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    FAILED = "failed"
    """It needs a person: ``sagas retry`` or ``sagas skip``."""


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
ENDED = frozenset({Status.COMPLETED, Status.COMPENSATED})


class Phase(enum.StrEnum):
    """Which way the saga goes."""

    FORWARD = "forward"
    COMPENSATING = "compensating"
    ENDED = "ended"


class Wait(enum.StrEnum):
    """What a waiting saga waits for."""

    REPLY = "do"
    """The reply (or rejection) of a step's command."""
    UNDO = "undo"
    """The reply of a compensation declared with ``reply=``."""
    BACKOFF = "retry"
    """The backoff before a step past the pivot is sent again."""


class Action(enum.StrEnum):
    """What a command does: a step's (``do``) or its compensation's (``undo``)."""

    DO = "do"
    UNDO = "undo"


class TimerKind(enum.StrEnum):
    """The three kinds of timers a saga has."""

    DEADLINE = "step"
    """A step's (or a waited-for compensation's) timeout."""
    BACKOFF = "retry"
    """The wait before a step past the pivot is sent again."""
    NAMED = "named"
    """One of the saga's ``@on_timer`` timers."""


def timer_key(kind: TimerKind, name: str) -> str:
    """The timer's name, as the history, ``sagas show`` and the test kit say it:
    ``step:<step>``, ``retry:<step>``, or a named timer's own name (which ``on_timer`` keeps
    from starting with those)."""
    return name if kind is TimerKind.NAMED else f"{kind.value}:{name}"


def timer_row(kind: TimerKind, name: str) -> str:
    """The timer's row in the store's timer table: a named timer's name, else
    :data:`WAIT_ROW`."""
    return name if kind is TimerKind.NAMED else WAIT_ROW


@dataclass(frozen=True)
class Waiting:
    """The one thing a saga waits for."""

    step: str
    wait: Wait
    command_id: str | None = None
    """The command answered (for a backoff: the attempt that failed)."""


@dataclass(frozen=True)
class Timer:
    """One timer set: its kind, the step (or named timer) it is for, when, its token, and
    its row in the store's timer table (:func:`timer_row`; a control of the first release
    keeps its own rows, named like the timers)."""

    kind: TimerKind
    name: str
    due: float
    token: str
    row: str

    @property
    def key(self) -> str:
        """Its name (:func:`timer_key`)."""
        return timer_key(self.kind, self.name)


@dataclass(frozen=True)
class Issued:
    """A command the saga sent."""

    id: str
    step: str
    action: Action
    attempt: int


@dataclass(frozen=True)
class Kept:
    """An input that reached the saga before its start: its envelope's JSON form."""

    id: str
    envelope: dict[str, Any]


@dataclass(frozen=True)
class Resume:
    """What a person's ``sagas retry`` or ``sagas skip`` acts on.

    ``step`` and ``action``: the step (or compensation) that failed. ``timer``: a timer whose
    firing raised (retry fires it again, skip drops it), with ``status`` the saga had then
    and its other timers (``suspended``: set again when it resumes). ``reason``: the saga's
    reason to restore when it resumes (why it compensates).
    """

    step: str | None
    action: Action | None
    reason: str | None = None
    timer: Timer | None = None
    status: Status | None = None
    suspended: tuple[Timer, ...] = ()


@dataclass
class Control:
    """Where a saga is (see the module docstring)."""

    key: str
    status: Status = Status.RUNNING
    phase: Phase = Phase.FORWARD
    at: str | None = None
    waiting: Waiting | None = None
    done: list[str] = field(default_factory=list)
    undo: list[str] | None = None  # compensations left, newest first (None: not chosen yet)
    timers: dict[str, Timer] = field(default_factory=dict)
    issued: list[Issued] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    undo_attempts: dict[str, int] = field(default_factory=dict)
    pivoted: bool = False
    reason: str | None = None
    resume: Resume | None = None
    kept: list[Kept] = field(default_factory=list)
    origin_ms: int = 0
    correlation_id: str | None = None
    seq: int = 0  # inputs applied: names timer tokens

    def timer_at(self, row: str) -> Timer | None:
        """The timer set in the store's timer row ``row``, if any."""
        return next((t for t in self.timers.values() if t.row == row), None)

    def issued_as(self, command_id: str | None) -> Issued | None:
        """The command this saga sent with ``command_id``, if it sent one."""
        if command_id is None:
            return None
        return next((i for i in self.issued if i.id == command_id), None)

    def last_issued(self, step: str, action: Action) -> Issued | None:
        """The newest command of ``step`` doing ``action``."""
        return next(
            (i for i in reversed(self.issued) if i.step == step and i.action is action), None
        )

    def copy(self) -> Control:
        """A control of its own (new lists and dicts; the timers, commands and the rest
        are immutable): what :meth:`from_dict` of :meth:`as_dict` gives, without the JSON."""
        return Control(
            key=self.key,
            status=self.status,
            phase=self.phase,
            at=self.at,
            waiting=self.waiting,
            done=list(self.done),
            undo=None if self.undo is None else list(self.undo),
            timers=dict(self.timers),
            issued=list(self.issued),
            attempts=dict(self.attempts),
            undo_attempts=dict(self.undo_attempts),
            pivoted=self.pivoted,
            reason=self.reason,
            resume=self.resume,
            kept=[Kept(k.id, dict(k.envelope)) for k in self.kept],
            origin_ms=self.origin_ms,
            correlation_id=self.correlation_id,
            seq=self.seq,
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (new lists and dicts: changing this control later leaves it)."""
        return {
            "v": _VERSION,
            "key": self.key,
            "status": self.status.value,
            "phase": self.phase.value,
            "at": self.at,
            "waiting": _waiting_dict(self.waiting),
            "done": list(self.done),
            "undo": None if self.undo is None else list(self.undo),
            "timers": [_timer_dict(t) for t in self.timers.values()],
            "issued": [[i.id, i.step, i.action.value, i.attempt] for i in self.issued],
            "attempts": dict(self.attempts),
            "undo_attempts": dict(self.undo_attempts),
            "pivoted": self.pivoted,
            "reason": self.reason,
            "resume": _resume_dict(self.resume),
            "kept": [{"id": k.id, "envelope": k.envelope} for k in self.kept],
            "origin_ms": self.origin_ms,
            "correlation_id": self.correlation_id,
            "seq": self.seq,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Control:
        """Read back :meth:`as_dict` (or a control of the first release, see the module
        docstring). The control owns new lists and dicts: the machine changes it in place,
        and ``data`` may be what the store holds (the memory store returns its own
        envelopes), which a handling that rolls back must leave unchanged."""
        if data.get("v") is None:
            return _legacy(data)
        timers = [_timer(t) for t in data.get("timers", [])]
        return cls(
            key=data["key"],
            status=Status(data["status"]),
            phase=Phase(data["phase"]),
            at=data.get("at"),
            waiting=_waiting(data.get("waiting")),
            done=list(data.get("done", [])),
            undo=None if data.get("undo") is None else list(data["undo"]),
            timers={t.key: t for t in timers},
            issued=[Issued(i[0], i[1], Action(i[2]), int(i[3])) for i in data.get("issued", [])],
            attempts=dict(data.get("attempts", {})),
            undo_attempts=dict(data.get("undo_attempts", {})),
            pivoted=bool(data.get("pivoted", False)),
            reason=data.get("reason"),
            resume=_resume(data.get("resume")),
            kept=[Kept(k["id"], dict(k["envelope"])) for k in data.get("kept", [])],
            origin_ms=int(data.get("origin_ms", 0)),
            correlation_id=data.get("correlation_id"),
            seq=int(data.get("seq", 0)),
        )


def _waiting_dict(w: Waiting | None) -> dict[str, Any] | None:
    return None if w is None else {"step": w.step, "wait": w.wait.value, "command": w.command_id}


def _waiting(d: dict[str, Any] | None) -> Waiting | None:
    return None if d is None else Waiting(d["step"], Wait(d["wait"]), d.get("command"))


def _timer_dict(t: Timer) -> dict[str, Any]:
    return {"kind": t.kind.value, "name": t.name, "due": t.due, "token": t.token, "row": t.row}


def _timer(d: dict[str, Any]) -> Timer:
    return Timer(TimerKind(d["kind"]), d["name"], float(d["due"]), d["token"], d["row"])


def _resume_dict(r: Resume | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "step": r.step,
        "action": None if r.action is None else r.action.value,
        "reason": r.reason,
        "timer": None if r.timer is None else _timer_dict(r.timer),
        "status": None if r.status is None else r.status.value,
        "suspended": [_timer_dict(t) for t in r.suspended],
    }


def _resume(d: dict[str, Any] | None) -> Resume | None:
    if d is None:
        return None
    return Resume(
        d.get("step"),
        None if d.get("action") is None else Action(d["action"]),
        d.get("reason"),
        None if d.get("timer") is None else _timer(d["timer"]),
        None if d.get("status") is None else Status(d["status"]),
        tuple(_timer(t) for t in d.get("suspended", [])),
    )


# -- the first release's control -------------------------------------------------------------

_LEGACY_PREFIXES = ((TimerKind.DEADLINE, "step:"), (TimerKind.BACKOFF, "retry:"))


def _legacy_timer(name: str, d: dict[str, Any]) -> Timer:
    """A timer of the first release, named ``step:<step>``, ``retry:<step>`` or its own
    name: the one place such a name is taken apart."""
    for kind, prefix in _LEGACY_PREFIXES:
        if name.startswith(prefix):
            return Timer(kind, name[len(prefix) :], float(d["due"]), d["token"], name)
    return Timer(TimerKind.NAMED, name, float(d["due"]), d["token"], name)


def _legacy(data: dict[str, Any]) -> Control:
    """A control written by the first release, in this form. Its ``issued`` ids carry no
    step: they are kept as answers to an unknown step, so a reply to one is still known as
    this saga's own command."""
    w = data.get("waiting")
    waiting = None if w is None else Waiting(w["step"], Wait(w["kind"]), w.get("command_id"))
    attempts: dict[str, int] = {}
    undo_attempts: dict[str, int] = {}
    for name, n in data.get("attempts", {}).items():
        if name.startswith("undo:"):
            undo_attempts[name[len("undo:") :]] = int(n)
        else:
            attempts[name] = int(n)
    r = data.get("resume")
    resume = None if r is None else Resume(r["step"], Action(r["kind"]), r.get("reason"))
    done = list(data.get("done", []))
    at = waiting.step if waiting else resume.step if resume else (done[-1] if done else None)
    if waiting is not None and waiting.command_id is not None:
        # The waiting command is the step's newest attempt: matching replies needs it.
        action = Action.UNDO if waiting.wait is Wait.UNDO else Action.DO
        attempt = (undo_attempts if action is Action.UNDO else attempts).get(waiting.step, 1)
        current = [Issued(waiting.command_id, waiting.step, action, attempt)]
    else:
        current = []
    others = [
        Issued(i, "", Action.DO, 0)
        for i in data.get("issued", [])
        if waiting is None or i != waiting.command_id
    ]
    timers = [_legacy_timer(n, t) for n, t in data.get("timers", {}).items()]
    status = Status(data.get("status", "running"))
    return Control(
        key=data["key"],
        status=status,
        phase=Phase(data.get("phase", "forward")),
        at=at,
        waiting=waiting,
        done=done,
        undo=list(data.get("undo", [])) if data.get("phase") == "compensating" else None,
        timers={t.key: t for t in timers},
        issued=others + current,
        attempts=attempts,
        undo_attempts=undo_attempts,
        pivoted=bool(data.get("pivoted", False)),
        reason=data.get("reason"),
        resume=resume,
        origin_ms=int(data.get("origin_ms", 0)),
        correlation_id=data.get("correlation_id"),
        seq=int(data.get("seq", 0)),
    )
