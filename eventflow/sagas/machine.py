"""The saga state machine: one input (a start event, a reply, a timer, an abort, a person's
retry or skip) applied to a loaded saga gives transitions, commands and timer changes.

It reads no clock and touches no store: the caller passes ``now`` (Unix seconds) and saves
the :class:`Outcome`. The runtime and the test kit (:mod:`eventflow.testing.sagas`) drive it
through the same handling code (:mod:`eventflow.sagas.handling`).

How a reader checks it: every input method changes the :class:`~.control.Control`, then
calls :meth:`~.progress.Progress._advance` once, which issues what comes next until the
saga waits or ends. A saga method (a step, a compensation, ``on_reply``, ``started``, a
timer method) is called by :meth:`~.progress.Progress._call`, which returns its result
once it has returned and takes the effects it asked for (timers set or cancelled:
applied; an abort: returned to the caller, which changes the state); nothing re-enters
``_advance``. Where the saga is
goes by step name (``Control.at``), so a deploy that adds, removes or reorders steps
leaves a running saga at its step; one that removes the step a saga is at fails it,
saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..events import Event
from .control import (
    ENDED,
    STATUSES,
    Action,
    Control,
    Issued,
    Kept,
    Phase,
    Resume,
    Status,
    Timer,
    TimerKind,
    Wait,
    Waiting,
)
from .definition import Step
from .outcome import Command, Early, Outcome, Transition
from .progress import Progress, refusal

__all__ = ["STATUSES", "Command", "Control", "Early", "Machine", "Outcome", "Transition"]


class Machine(Progress):
    """Applies inputs to one saga; each input method returns the :class:`Outcome`."""

    # -- inputs --------------------------------------------------------------------------

    async def start(
        self,
        event: Event,
        message_id: str,
        correlation_id: str,
        early: Sequence[Early] = (),
    ) -> Outcome:
        """The start event of a new saga, then the inputs kept before it (``early``, in
        arrival order). An abort among them ends the saga at the start, with nothing done."""
        self._begin(message_id)
        c = self.control
        c.origin_ms = c.origin_ms or int(self.now * 1000)
        c.correlation_id = correlation_id
        c.status, c.kept = Status.RUNNING, []
        self._note("started")
        started = getattr(self.saga, "started", None)
        if started is not None:
            await self._obey(await self._call(started, event))
        if not any(self.definition.is_abort(e.event) for e in early):
            await self._advance()
        for e in early:
            await self.message(e.event, e.message_id, e.causation_id)
        return self.out

    def keep(self, envelope: dict[str, Any], message_id: str, event_type: str) -> Outcome:
        """An input for a saga that has not started: kept, applied after the start."""
        self._begin(message_id)
        c = self.control
        if any(k.id == message_id for k in c.kept):
            return self._ignore(f"{event_type} kept already")
        c.status = Status.PENDING
        c.origin_ms = c.origin_ms or int(self.now * 1000)
        c.kept.append(Kept(message_id, envelope))
        self._note("kept", None, f"{event_type} before the start: applied after it")
        return self.out

    def ignored(self, message_id: str | None, detail: str, step: str | None = None) -> Outcome:
        """An input that changes nothing, recorded in the history."""
        self._begin(message_id)
        return self._ignore(detail, step)

    async def message(self, event: Event, message_id: str, causation_id: str | None) -> Outcome:
        """A reply, a rejection or an abort event for this saga's key."""
        self._begin(message_id)
        c, etype = self.control, event.event_type
        if self.definition.is_abort(event):
            self._abort(f"aborted by {etype}", None)
            await self._advance()
            return self.out
        if c.status in ENDED or c.status is Status.FAILED:
            return self._ignore(f"{etype} for a saga already {c.status}")
        w = c.waiting
        if w is None:
            return self._ignore(f"{etype} while no step waits for a reply")
        s = self.definition.find(w.step)
        if s is None:
            return self._removed(w.step)
        answers = c.issued_as(causation_id)
        if w.wait is Wait.UNDO:
            return await self._undo_reply(s, event, answers)
        earlier = answers if answers is not None and answers.id != w.command_id else None
        success = _is(event, s.reply)
        if earlier is not None and not (success and self._late_success(s, earlier)):
            return self._ignore(f"{etype} answers an earlier command ({earlier.id})", s.name)
        if success:
            late = "" if earlier is None else f" (to attempt {earlier.attempt})"
            await self._replied(s, event, etype + late)
        elif _is(event, s.reject):
            if w.wait is Wait.BACKOFF:
                return self._ignore(f"{etype} while step {s.name} waits for its backoff", s.name)
            self._cancel(TimerKind.DEADLINE, s.name)
            c.waiting = None
            self._note("rejected", s.name, etype)
            self._step_failed(s, f"{s.name} rejected ({etype})", compensate_it=False)
        else:
            return self._ignore(f"{etype} does not answer step {s.name}", s.name)
        await self._advance()
        return self.out

    async def timer(self, name: str, token: str, message_id: str) -> Outcome:
        """A timer fired: ``name`` is its row in the store's timer table (the ``timer``
        column: :func:`.control.timer_row`), ``token`` the setting it was fired for. This
        is what the timer loop calls, in the store transaction of the firing; when it
        raises (saga code did), roll that transaction back and apply :meth:`timer_failed`
        in a new one."""
        self._begin(message_id)
        t = self.control.timer_at(name)
        if t is None or t.token != token:
            return self._ignore(_stale(token))
        await self._fired(t)
        await self._advance()
        return self.out

    def timer_failed(self, name: str, token: str, message_id: str, error: str) -> Outcome:
        """The firing of timer ``name`` raised ``error`` (saga code did): the saga is
        ``failed`` there, and ``sagas retry`` fires the timer again. Its other timers wait
        with it (set again when a person resumes it: a failed saga fires nothing); nothing
        else changes (the firing's own transaction was rolled back)."""
        self._begin(message_id)
        c = self.control
        t = c.timer_at(name)
        if t is None or t.token != token:
            return self._ignore(_stale(token))
        others = tuple(o for o in c.timers.values() if o.row != name)
        c.timers = {}
        self.out.timers_cancelled.update([name, *(o.row for o in others)])
        step = t.name if t.kind is not TimerKind.NAMED else None
        c.resume = Resume(step, None, c.reason, t, c.status, others)
        c.status = Status.FAILED
        c.reason = f"timer {t.key} raised {error}"
        self._note("failed", step, c.reason)
        return self.out

    async def abort(self, reason: str, message_id: str | None, by: str | None) -> Outcome:
        """Abort from outside (the CLI): compensate what was done."""
        self._begin(message_id)
        self._abort(reason, by)
        await self._advance()
        return self.out

    async def retry(self, by: str | None, message_id: str | None) -> Outcome:
        """A person resumes a failed saga: the failed step (or compensation) is issued again
        under a new attempt (a new command id), or the timer that raised fires again."""
        r = self._resumed("retry", message_id)
        if r is None:
            return self.out
        c = self.control
        if r.timer is not None:
            self._note("retried", r.step, f"timer {r.timer.key} again", by)
            await self._fired(r.timer)
        elif r.action is Action.UNDO:
            assert r.step is not None
            self._note("retried", r.step, "undo again", by)
            c.undo_attempts[r.step] = c.undo_attempts.get(r.step, 1) + 1
            c.undo = [r.step, *(c.undo or [])]
            c.status, c.phase = Status.COMPENSATING, Phase.COMPENSATING
        else:
            assert r.step is not None
            self._note("retried", r.step, "do again", by)
            c.attempts[r.step] = c.attempts.get(r.step, 1) + 1
            c.status, c.phase = Status.RUNNING, Phase.FORWARD
            self._rerun = r.step
        await self._advance()
        return self.out

    async def skip(self, by: str | None, message_id: str | None) -> Outcome:
        """A person handled the failed step (or compensation) by hand: go on past it. For a
        timer that raised: it is dropped, not fired."""
        r = self._resumed("skip", message_id)
        if r is None:
            return self.out
        c = self.control
        if r.timer is not None:
            self._note("skipped", r.step, f"timer {r.timer.key} dropped", by)
        elif r.action is Action.UNDO:
            self._note("skipped", r.step, "undo handled by hand", by)
            c.status, c.phase = Status.COMPENSATING, Phase.COMPENSATING
        else:
            assert r.step is not None
            self._note("skipped", r.step, "do handled by hand", by)
            c.status, c.phase = Status.RUNNING, Phase.FORWARD
            s = self.definition.find(r.step)
            if s is not None:
                self._step_done(s)
            else:  # removed by a deploy: go on from the first step not done
                c.done.append(r.step)
                c.at = None
        await self._advance()
        return self.out

    # -- what an input does ------------------------------------------------------------------

    def _resumed(self, what: str, message_id: str | None) -> Resume | None:
        """A person's ``what`` (``retry``, ``skip``) begins: the failure it resumes from
        (its reason restored; for a timer that raised, the status and the timers that waited
        with it too), or None when the saga is not failed (recorded as ignored)."""
        self._begin(message_id)
        c, r = self.control, self.control.resume
        why = refusal(c, what)
        if why is not None or r is None:
            self._ignore(f"{what} of a saga that is {c.status}: {why}")
            return None
        c.resume, c.reason = None, r.reason
        if r.timer is not None:
            c.status = r.status or Status.RUNNING
            self._resume_timers(r)
        return r

    def _resume_timers(self, r: Resume) -> None:
        """The timers that waited while the saga was failed, set again as they were (those
        due meanwhile fire at once)."""
        for t in r.suspended:
            self.control.timers[t.key] = t
            self.out.timers_set[t.row] = (t.due, t.token)
            self.out.timers_cancelled.discard(t.row)

    async def _fired(self, t: Timer) -> None:
        """A current timer fires: its setting goes, then its kind decides."""
        c = self.control
        c.timers.pop(t.key, None)
        self.out.timers_cancelled.add(t.row)  # its row goes with this transition
        w = c.waiting
        if t.kind is TimerKind.NAMED:
            if c.status in ENDED:
                self._ignore(f"timer {t.key} for a saga already {c.status}")
                return
            self._note("timer-fired", None, t.name)
            method = getattr(self.saga, self.definition.timers[t.name])
            result = await self._call(method)
            if isinstance(result.value, Event):
                self.out.messages.append(result.value)
            elif result.value is not None:
                raise TypeError(
                    f"saga {self.definition.name}: {method.__name__} returned "
                    f"{result.value!r}; a timer method returns an event to publish (an Event "
                    "instance) or None"
                )
            await self._obey(result)
            return
        backoff = t.kind is TimerKind.BACKOFF
        if w is None or w.step != t.name or (w.wait is Wait.BACKOFF) is not backoff:
            self._ignore(f"timer {t.key} for a step no longer waiting", t.name)
            return
        s = self.definition.find(t.name)
        if s is None:
            self._removed(t.name)
            return
        c.waiting = None
        if t.kind is TimerKind.BACKOFF:
            c.attempts[s.name] = c.attempts.get(s.name, 1) + 1
            self._rerun = s.name
        elif w.wait is Wait.UNDO:
            assert s.compensation is not None
            self._note("timed-out", s.name, f"{s.compensation.name} got no reply")
            self._fail(
                f"compensation {s.compensation.name} got no reply within {s.compensation.timeout}s",
                Resume(s.name, Action.UNDO, c.reason),
            )
        else:
            self._note("timed-out", s.name, f"no reply within {s.timeout}s")
            self._step_failed(s, f"{s.name} timed out", compensate_it=True)

    async def _replied(self, s: Step, event: Event, detail: str) -> None:
        """A step succeeded: done before its ``on_reply`` runs (an abort from there
        compensates it too)."""
        c = self.control
        self._cancel(TimerKind.DEADLINE, s.name)
        self._cancel(TimerKind.BACKOFF, s.name)
        c.waiting = None
        self._note("replied", s.name, detail)
        self._step_done(s)
        if s.reply_handler is not None:
            await self._obey(await self._call(s.reply_handler, self.saga, event))

    def _late_success(self, s: Step, answered: Issued) -> bool:
        """Past the pivot, a success reply to an earlier attempt of the step waiting (or
        backing off) is its success."""
        return self.control.pivoted and answered.step == s.name and answered.action is Action.DO

    async def _undo_reply(self, s: Step, event: Event, answers: Issued | None) -> Outcome:
        c, etype = self.control, event.event_type
        w = c.waiting
        assert w is not None and s.compensation is not None
        if answers is not None and answers.id != w.command_id:
            return self._ignore(f"{etype} answers an earlier command ({answers.id})", s.name)
        if not _is(event, s.compensation.reply):
            return self._ignore(f"{etype} is not the reply of {s.compensation.name}", s.name)
        self._cancel(TimerKind.DEADLINE, s.name)
        c.waiting = None
        self._note("compensated", s.name, etype)
        await self._advance()
        return self.out

    def _step_failed(self, s: Step, reason: str, *, compensate_it: bool) -> None:
        """A forward step was rejected or timed out: past the pivot, back off and send it
        again; else compensate (a timed-out step too: its command may have taken effect).
        When an abort waits for this step's outcome, compensating goes on."""
        c = self.control
        if c.pivoted and c.phase is Phase.FORWARD:
            attempt = c.attempts.get(s.name, 1)
            if attempt >= s.retry:
                self._fail(
                    f"{reason}; out of its {s.retry} attempts past the pivot",
                    Resume(s.name, Action.DO),
                )
                return
            delay = s.retry_delay * 2 ** (attempt - 1)
            last = c.last_issued(s.name, Action.DO)
            c.waiting = Waiting(s.name, Wait.BACKOFF, last.id if last else None)
            self._set(TimerKind.BACKOFF, s.name, delay)
            self._note("retry-scheduled", s.name, f"attempt {attempt + 1} in {delay:g}s")
            return
        if compensate_it:
            c.done.append(s.name)
        if c.phase is Phase.FORWARD:  # else an abort waited for this outcome
            self._compensate(reason)


def _is(event: Event, classes: tuple[type[Event], ...]) -> bool:
    return any(event.event_type == cls.event_type for cls in classes)


def _stale(token: str) -> str:
    return f"timer setting {token} fired after it was cancelled or rescheduled"
