"""The saga state machine: one input (a start event, a reply, a timer, an abort, a person's
retry or skip) applied to a loaded saga gives transitions, commands and timer changes.

It reads no clock and touches no store: the caller passes ``now`` (Unix seconds) and saves
the :class:`Outcome`. The runtime and the test kit (a virtual clock) both drive it.

Control state (``Control``) is saved beside the saga's own fields after every input:

- ``phase``: ``forward`` (steps in definition order), ``compensating`` (compensations of
  the steps done, newest first) or ``ended``.
- ``waiting``: the one thing the saga waits for: a step's reply (``do``), a compensation's
  reply (``undo``), or the backoff before a step past the pivot is sent again (``retry``).
- ``timers``: the timers set (a step's deadline ``step:<name>``, a retry ``retry:<name>``
  and the saga's named timers), each with the token of its setting: a timer that fires
  with another token was cancelled or rescheduled, and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..envelope import hashed_id
from ..events import Event
from .definition import Saga, SagaDefinition, Step, is_async

__all__ = ["Control", "Machine", "Outcome", "Transition"]

RUNNING, COMPLETED, COMPENSATING, COMPENSATED, FAILED = (
    "running",
    "completed",
    "compensating",
    "compensated",
    "failed",
)
STATUSES = (RUNNING, COMPLETED, COMPENSATING, COMPENSATED, FAILED)
ENDED = (COMPLETED, COMPENSATED)


@dataclass(frozen=True)
class Transition:
    """One entry of a saga's history."""

    kind: str
    step: str | None
    at: datetime
    message_id: str | None
    detail: str = ""
    by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form saved in the saga's stream."""
        return {
            "kind": self.kind,
            "step": self.step,
            "at": self.at.isoformat(),
            "message_id": self.message_id,
            "detail": self.detail,
            "by": self.by,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transition:
        """Read back :meth:`as_dict`."""
        return cls(
            data["kind"],
            data.get("step"),
            datetime.fromisoformat(data["at"]),
            data.get("message_id"),
            data.get("detail", ""),
            data.get("by"),
        )


@dataclass
class Control:
    """Where a saga is (saved with its fields; see the module docstring)."""

    key: str
    status: str = RUNNING
    phase: str = "forward"
    next_step: int = 0
    waiting: dict[str, Any] | None = None
    done: list[str] = field(default_factory=list)
    undo: list[str] = field(default_factory=list)
    timers: dict[str, dict[str, Any]] = field(default_factory=dict)
    issued: list[str] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    pivoted: bool = False
    reason: str | None = None
    resume: dict[str, str] | None = None  # what `sagas retry` / `skip` act on
    origin_ms: int = 0
    correlation_id: str | None = None
    seq: int = 0  # inputs applied: names timer tokens

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (a copy: changing this control later leaves it as it is)."""
        return {name: _json_copy(getattr(self, name)) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Control:
        """Read back :meth:`as_dict` (unknown keys from a newer version are ignored). The
        control owns copies: the machine changes it in place, and ``data`` may be what the
        store holds (the memory store returns its own envelopes), which a handling that
        rolls back must leave unchanged."""
        known = cls.__dataclass_fields__
        return cls(**{k: _json_copy(v) for k, v in data.items() if k in known})


def _json_copy(value: Any) -> Any:
    """A copy of a JSON value's lists and dicts (the scalars are immutable)."""
    if isinstance(value, dict):
        return {k: _json_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_copy(v) for v in value]
    return value


@dataclass
class Outcome:
    """What one input did: to save, send and schedule."""

    transitions: list[Transition] = field(default_factory=list)
    commands: list[tuple[Event, str]] = field(default_factory=list)  # (command, its id)
    messages: list[Event] = field(default_factory=list)  # plain events from timer methods
    timers_set: dict[str, tuple[float, str]] = field(default_factory=dict)  # name: (due, token)
    timers_cancelled: set[str] = field(default_factory=set)

    @property
    def changed(self) -> bool:
        """False when the input changed nothing but the history (ignored)."""
        return any(t.kind != "ignored" for t in self.transitions)


class Machine:
    """Applies inputs to one saga; each method returns the :class:`Outcome` of one input."""

    def __init__(self, saga: Saga, control: Control, now: float) -> None:
        self.saga = saga
        self.definition: SagaDefinition = type(saga).definition
        self.control = control
        self.now = now
        self.out = Outcome()
        self._message_id: str | None = None

    # -- inputs --------------------------------------------------------------------------

    async def start(self, event: Event, message_id: str, correlation_id: str) -> Outcome:
        """The start event of a new saga."""
        self._begin(message_id)
        c = self.control
        c.origin_ms = int(self.now * 1000)
        c.correlation_id = correlation_id
        self._note("started")
        started = getattr(self.saga, "started", None)
        if started is not None:
            result = started(event)
            if is_async(result):
                await result
            await self._effects()
        await self._advance()
        return self.out

    def ignored(self, message_id: str | None, detail: str, step: str | None = None) -> Outcome:
        """An input that changes nothing, recorded in the history."""
        self._begin(message_id)
        self._note("ignored", step, detail)
        return self.out

    async def message(self, event: Event, message_id: str, causation_id: str | None) -> Outcome:
        """A reply, a rejection or an abort event for this saga's key."""
        self._begin(message_id)
        c, etype = self.control, event.event_type
        if any(etype == cls.event_type for cls in self.definition.abort):
            return await self._abort(f"aborted by {etype}", None)
        if c.status in ENDED:
            return self._ignore(f"{etype} for a saga already {c.status}")
        w = c.waiting
        if w is None or w["kind"] == "retry":
            return self._ignore(f"{etype} while no step waits for a reply")
        if causation_id != w["command_id"] and causation_id in c.issued:
            return self._ignore(f"{etype} answers an earlier command ({causation_id})", w["step"])
        s = self.definition.step(w["step"])
        if w["kind"] == "undo":
            assert s.compensation is not None
            if not _is(event, s.compensation.reply):
                return self._ignore(f"{etype} is not the reply of {s.compensation.name}", s.name)
            self._cancel(f"step:{s.name}")
            c.waiting = None
            self._note("compensated", s.name, etype)
            await self._advance()
            return self.out
        if _is(event, s.reply):
            self._cancel(f"step:{s.name}")
            c.waiting = None
            self._note("replied", s.name, etype)
            # Done before its handler runs: an abort from the handler compensates it too.
            self._step_done(s)
            if s.reply_handler is not None:
                result = s.reply_handler(self.saga, event)
                if is_async(result):
                    await result
                await self._effects()
            await self._advance()
        elif _is(event, s.reject):
            self._cancel(f"step:{s.name}")
            c.waiting = None
            self._note("rejected", s.name, etype)
            await self._failed_forward(s, f"{s.name} rejected ({etype})", compensate_it=False)
        else:
            return self._ignore(f"{etype} does not answer step {s.name}", s.name)
        return self.out

    async def timer(self, name: str, token: str, message_id: str) -> Outcome:
        """A timer fired (``token``: the setting it was fired for)."""
        self._begin(message_id)
        c = self.control
        current = c.timers.get(name)
        if current is None or current["token"] != token:
            return self._ignore(f"timer {name} fired after it was cancelled or rescheduled")
        del c.timers[name]
        self.out.timers_cancelled.add(name)  # its row goes with this transition
        w = c.waiting
        if name.startswith("step:"):
            step_name = name[5:]
            if w is None or w["step"] != step_name or w["kind"] == "retry":
                return self._ignore(f"timer {name} for a step no longer waiting", step_name)
            s = self.definition.step(step_name)
            c.waiting = None
            if w["kind"] == "undo":
                assert s.compensation is not None
                self._note("timed-out", s.name, f"{s.compensation.name} got no reply")
                self._fail(
                    f"compensation {s.compensation.name} got no reply within "
                    f"{s.compensation.timeout}s",
                    {"step": s.name, "kind": "undo"},
                )
                return self.out
            self._note("timed-out", s.name, f"no reply within {s.timeout}s")
            await self._failed_forward(s, f"{s.name} timed out", compensate_it=True)
        elif name.startswith("retry:"):
            step_name = name[6:]
            if w is None or w["kind"] != "retry" or w["step"] != step_name:
                return self._ignore(f"timer {name} for a step no longer waiting", step_name)
            c.waiting = None
            c.attempts[step_name] = c.attempts.get(step_name, 1) + 1
            await self._advance()
        else:
            if c.status in ENDED:
                return self._ignore(f"timer {name} for a saga already {c.status}")
            self._note("timer-fired", None, name)
            method = getattr(self.saga, self.definition.timers[name])
            result = method()
            if is_async(result):
                result = await result
            if isinstance(result, Event):
                self.out.messages.append(result)
            elif result is not None:
                raise TypeError(
                    f"saga {self.definition.name}: {method.__name__} returned {result!r}; a "
                    "timer method returns an event to publish (an Event instance) or None"
                )
            await self._effects()
            await self._advance()
        return self.out

    async def abort(self, reason: str, message_id: str | None, by: str | None) -> Outcome:
        """Abort from outside (the CLI): compensate what was done."""
        self._begin(message_id)
        return await self._abort(reason, by)

    async def retry(self, by: str | None, message_id: str | None) -> Outcome:
        """A person resumes a failed saga: the failed step (or compensation) is issued again
        under a new attempt (a new command id)."""
        self._begin(message_id)
        c = self.control
        if c.status != FAILED or c.resume is None:
            return self._ignore(f"retry asked of a saga that is {c.status}")
        step_name, kind, c.reason = c.resume["step"], c.resume["kind"], c.resume.get("reason")
        c.resume = None
        self._note("retried", step_name, f"{kind} again", by)
        if kind == "undo":
            c.attempts[f"undo:{step_name}"] = c.attempts.get(f"undo:{step_name}", 1) + 1
            c.undo.insert(0, step_name)
            c.status, c.phase = COMPENSATING, "compensating"
        else:
            c.attempts[step_name] = c.attempts.get(step_name, 1) + 1
            c.status, c.phase = RUNNING, "forward"
        await self._advance()
        return self.out

    async def skip(self, by: str | None, message_id: str | None) -> Outcome:
        """A person handled the failed step (or compensation) by hand: go on past it."""
        self._begin(message_id)
        c = self.control
        if c.status != FAILED or c.resume is None:
            return self._ignore(f"skip asked of a saga that is {c.status}")
        step_name, kind, c.reason = c.resume["step"], c.resume["kind"], c.resume.get("reason")
        c.resume = None
        self._note("skipped", step_name, f"{kind} handled by hand", by)
        if kind == "undo":
            c.status, c.phase = COMPENSATING, "compensating"
        else:
            c.status, c.phase = RUNNING, "forward"
            self._step_done(self.definition.step(step_name))
        await self._advance()
        return self.out

    # -- the machine ------------------------------------------------------------------------

    def _begin(self, message_id: str | None) -> None:
        self._message_id = message_id
        self.control.seq += 1

    def _note(
        self, kind: str, step: str | None = None, detail: str = "", by: str | None = None
    ) -> None:
        at = datetime.fromtimestamp(self.now, UTC)
        self.out.transitions.append(Transition(kind, step, at, self._message_id, detail, by))

    def _ignore(self, detail: str, step: str | None = None) -> Outcome:
        self._note("ignored", step, detail)
        return self.out

    def _step_done(self, s: Step) -> None:
        c = self.control
        c.done.append(s.name)
        c.pivoted = c.pivoted or s.pivot
        c.next_step = self.definition.steps.index(s) + 1

    async def _failed_forward(self, s: Step, reason: str, *, compensate_it: bool) -> None:
        """A forward step was rejected or timed out: retry it past the pivot, else
        compensate (a timed-out step too: its command may have taken effect)."""
        c = self.control
        if c.pivoted:
            attempt = c.attempts.get(s.name, 1)
            if attempt >= s.retry:
                self._fail(
                    f"{reason}; out of its {s.retry} attempts past the pivot",
                    {
                        "step": s.name,
                        "kind": "do",
                    },
                )
                return
            delay = s.retry_delay * 2 ** (attempt - 1)
            c.waiting = {"step": s.name, "kind": "retry"}
            self._set(f"retry:{s.name}", delay)
            self._note("retry-scheduled", s.name, f"attempt {attempt + 1} in {delay:g}s")
            return
        if compensate_it:
            c.done.append(s.name)
        await self._compensate(reason)

    async def _abort(self, reason: str, by: str | None) -> Outcome:
        c = self.control
        if c.status in ENDED or c.phase == "compensating":
            return self._ignore(f"abort ({reason}) of a saga already {c.status}")
        if c.pivoted:
            return self._ignore(f"abort ({reason}) after the pivot: the saga only goes forward")
        w = c.waiting
        if w is not None:
            self._cancel(f"step:{w['step']}")
            self._cancel(f"retry:{w['step']}")
            if w["kind"] == "do":
                c.done.append(w["step"])  # its command may have taken effect
            c.waiting = None
        self._note("aborted", None, reason, by)
        await self._compensate(reason)
        return self.out

    async def _compensate(self, reason: str) -> None:
        c = self.control
        c.status, c.phase, c.reason = COMPENSATING, "compensating", reason
        c.undo = [n for n in reversed(c.done) if self.definition.step(n).compensation is not None]
        self._note("compensating", None, reason)
        await self._advance()

    def _fail(self, reason: str, resume: dict[str, str]) -> None:
        c = self.control
        if resume["kind"] == "undo" and c.reason:
            # Why it compensates: back in .reason once a person resumes the compensation.
            resume = {**resume, "reason": c.reason}
        c.status, c.reason, c.resume, c.waiting = FAILED, reason, resume, None
        self._note("failed", resume["step"], reason)

    def _end(self, status: str) -> None:
        c = self.control
        c.status, c.phase, c.waiting = status, "ended", None
        for name in list(c.timers):
            self._cancel(name)
        self._note(status, None, c.reason or "")

    async def _advance(self) -> None:
        """Issue what comes next until the saga waits for something or ends."""
        c, steps = self.control, self.definition.steps
        while c.status not in (FAILED, *ENDED) and c.waiting is None:
            if c.phase == "forward":
                if c.next_step >= len(steps):
                    self._end(COMPLETED)
                    return
                s = steps[c.next_step]
                command = await self._call(s.fn)
                if c.phase != "forward":
                    return  # the step method aborted the saga: its command is not sent
                if command is None:
                    self._note("step-done", s.name, "local step")
                    self._step_done(s)
                    continue
                attempt = c.attempts.setdefault(s.name, 1)
                self._send(command, "do", s.name, attempt)
                if not s.reply:
                    self._step_done(s)  # nothing answers it: done once sent
                    continue
                c.waiting = {"step": s.name, "kind": "do", "command_id": c.issued[-1]}
                if s.timeout is not None:
                    self._set(f"step:{s.name}", s.timeout)
            else:
                if not c.undo:
                    self._end(COMPENSATED)
                    return
                name = c.undo.pop(0)
                comp = self.definition.step(name).compensation
                assert comp is not None
                command = await self._call(comp.fn)
                if command is None:
                    self._note("compensated", name, "local compensation")
                    continue
                attempt = c.attempts.setdefault(f"undo:{name}", 1)
                self._send(command, "undo", name, attempt)
                if comp.reply:
                    c.waiting = {"step": name, "kind": "undo", "command_id": c.issued[-1]}
                    if comp.timeout is not None:
                        self._set(f"step:{name}", comp.timeout)

    async def _call(self, fn: Any) -> Event | None:
        result = fn(self.saga)
        if is_async(result):
            result = await result
        await self._effects()
        if result is not None and not isinstance(result, Event):
            raise TypeError(
                f"saga {self.definition.name}: {fn.__name__} returned {result!r}; a step "
                "returns the command (an Event instance) or None"
            )
        return result

    def _send(self, command: Event, kind: str, step: str, attempt: int) -> None:
        c = self.control
        command_id = hashed_id(
            c.origin_ms, "saga", self.definition.name, c.key, kind, step, str(attempt)
        )
        c.issued.append(command_id)
        self.out.commands.append((command, command_id))
        what = "command-sent" if kind == "do" else "compensation-sent"
        self._note(what, step, f"{command.event_type} (attempt {attempt})")

    def _set(self, name: str, seconds: float) -> None:
        c = self.control
        token = f"{c.seq}:{name}"
        due = self.now + seconds
        c.timers[name] = {"due": due, "token": token}
        self.out.timers_set[name] = (due, token)
        self.out.timers_cancelled.discard(name)
        if not name.startswith(("step:", "retry:")):
            self._note("timer-set", None, f"{name} in {seconds:g}s")

    def _cancel(self, name: str) -> None:
        c = self.control
        if c.timers.pop(name, None) is not None:
            self.out.timers_cancelled.add(name)
            self.out.timers_set.pop(name, None)
            if not name.startswith(("step:", "retry:")):
                self._note("timer-cancelled", None, name)

    async def _effects(self) -> None:
        """Apply what a saga method asked for (timers, abort)."""
        effects, self.saga._effects = self.saga._effects, []
        for what, arg in effects:
            if what == "set":
                self._set(*arg)
            elif what == "cancel":
                self._cancel(arg)
            else:
                await self._abort(arg, None)


def _is(event: Event, classes: tuple[type[Event], ...]) -> bool:
    return any(event.event_type == cls.event_type for cls in classes)
