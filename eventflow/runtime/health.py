"""An app's health: its supervisor's view of the components, plus what fails inside a
component without failing it (a broker away, a projection failing on one event, an open
breaker)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigurationError
from ..limits import Limits
from ..ports import Broker, declared
from ..projections import ProjectionRunner
from ..supervision import Health, Supervisor

__all__ = ["app_health", "readiness_body"]


def app_health(
    supervisor: Supervisor,
    broker: Broker,
    runners: Sequence[ProjectionRunner],
    limits: Limits,
) -> Health:
    """The supervisor's health, ``degraded`` with a problem line for each of: the broker's
    connection problems, a projection failing on an event, an open breaker."""
    health = supervisor.health()
    # An open breaker pauses subscriptions; a broker away fails publishes; a projection
    # failing on one event retries it inside its runner, unseen by the supervisor.
    extra = (
        *_broker_problems(broker),
        *(p for r in runners if (p := r.problem()) is not None),
        *limits.problems(),
    )
    if not extra:
        return health
    return Health("degraded" if health.ok else health.status, health.problems + extra)


def readiness_body(app: str, health: Health) -> dict[str, object]:
    """The JSON body of a readiness answer (``/readyz`` on the app's port, and
    ``eventflow.asgi.readyz``): the app's name, its status and a line per problem."""
    return {"app": app, "status": health.status, "problems": list(health.problems)}


def _broker_problems(broker: Broker) -> tuple[str, ...]:
    # A broker written before the port declared problems() still runs an app (as one
    # without lag() does without sagas); its connection is then not in the health.
    try:
        problems = declared(broker, Broker, "problems")
    except ConfigurationError:
        return ()
    return tuple(problems())
