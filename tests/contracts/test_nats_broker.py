"""The broker contract suite on a real NATS JetStream server (``nats://``).

The server comes from ``EVENTFLOW_TEST_NATS_URL``, else the bundled ``nats-server`` started
for the session, else testcontainers; without any, the module skips (fails under CI=true).
Each test uses fresh topics and groups, so all share one server and one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from eventflow.adapters.kafka import KafkaBroker
from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.adapters.nats.config import consumer_name, group_id, partition_of
from eventflow.brokers import open_broker
from eventflow.errors import (
    BackpressureError,
    BrokerError,
    ConfigurationError,
    MessageRefusedError,
)
from eventflow.headers import MESSAGE_ID_HEADER, SEND_ID_HEADER
from eventflow.supervision import ComponentState, Supervisor
from eventflow.testing.broker_contract import (
    BrokerContract,
    BrokerFactory,
    SilentServer,
    broker_pool,
    collect,
    drain,
    eventually,
    unique_name,
)
from eventflow.testing.broker_contract.startup import BrokerAt, StartupContract, refused_start
from eventflow.testing.nats_server import NatsServer, find_nats_server
from eventflow.testing.services import free_port

pytestmark = pytest.mark.service("nats")


class TestNatsBroker(BrokerContract):
    """Every guarantee of the Broker port, on JetStream."""

    @pytest.fixture
    async def broker_factory(self, nats_url: str) -> AsyncIterator[BrokerFactory]:
        config = NatsBrokerConfig.from_url(f"{nats_url}?stream=EF_CONTRACT&storage=memory")
        async with broker_pool(lambda: NatsBroker(config)) as factory:
            yield factory


def test_from_url_parses_servers_credentials_and_options() -> None:
    """Several hosts, credentials and typed query options; the broker URL hides the password."""
    broker = NatsBroker.from_url(
        "nats://alice:s3cret@h1:4222,h2?stream=ORDERS&partitions=16&ack_wait=12.5&lease_ttl=20"
    )
    cfg = broker.config
    assert cfg.servers == ("nats://h1:4222", "nats://h2:4222")
    assert (cfg.user, cfg.password) == ("alice", "s3cret")
    assert (cfg.stream, cfg.partitions, cfg.ack_wait, cfg.lease_ttl) == ("ORDERS", 16, 12.5, 20.0)
    assert cfg.prefix == "orders"
    assert "s3cret" not in broker.url
    assert broker.url.startswith("nats://h1:4222,h2:4222")


def test_open_broker_builds_a_nats_broker() -> None:
    """``open_broker("nats://...")`` returns the NATS adapter, unstarted."""
    broker = open_broker("nats://127.0.0.1:4222")
    assert isinstance(broker, NatsBroker)
    assert broker.config.stream == "EVENTFLOW"


@pytest.mark.parametrize(
    "url",
    [
        "nats://h:4222?nope=1",
        "nats://h:4222?partitions=zero",
        "nats://h:4222?partitions=0",
        "nats://h:4222?stream=has.dot",
        "nats://h:4222?ack_wait=30&lease_ttl=10",
        "nats://h:4222?ack_wait=30&lease_ttl=35",  # shorter than ack_wait + ack_wait/3 + 1.5
        "nats://h:4222?max_deliver=1",
        "nats://h:4222?max_deliver=0",
        "nats://h:4222?max_deliver=-2",
        "kafka://h:9092",
    ],
)
def test_bad_urls_raise_configuration_error(url: str) -> None:
    """Unknown options, bad values and inconsistent timings are refused with a reason."""
    with pytest.raises(ConfigurationError):
        NatsBrokerConfig.from_url(url)


def test_partition_of_is_stable() -> None:
    """A key's partition does not depend on the process (CRC-32, not ``hash``)."""
    assert partition_of("order-1", 8) == zlib.crc32(b"order-1") % 8
    assert [partition_of(k, 8) for k in ("a", "b", "c")] == [
        zlib.crc32(k.encode()) % 8 for k in "abc"
    ]


# -- start-up: bounded, interruptible, and telling what to check ------------------------------


class TestNatsStartup(StartupContract):
    """The first connection: bounded by ``connect_timeout``, interruptible."""

    @pytest.fixture
    def broker_at(self) -> BrokerAt:
        """A NATS broker for ``127.0.0.1:port``."""
        return lambda port, timeout: NatsBroker.from_url(
            f"nats://127.0.0.1:{port}?connect_timeout={timeout}"
        )


async def test_a_refused_start_hides_the_password_and_names_the_timeout() -> None:
    """The error names the URL without its password: at once when the connection is
    refused, and with the connect timeout to raise when the server stays silent."""
    port = free_port()
    broker = NatsBroker.from_url(f"nats://alice:s3cret@127.0.0.1:{port}?connect_timeout=10")
    text = str(await refused_start(broker, within=2))
    assert "s3cret" not in text and f"127.0.0.1:{port}" in text
    async with SilentServer() as silent:
        url = f"nats://alice:s3cret@127.0.0.1:{silent.port}?connect_timeout=1"
        text = str(await refused_start(NatsBroker.from_url(url), within=4))
    assert "s3cret" not in text and f"127.0.0.1:{silent.port}" in text
    assert "connect_timeout=1s" in text


async def test_a_silent_port_is_named_as_the_wrong_port() -> None:
    """A port that accepts and never greets: the error asks for the client port."""
    async with SilentServer() as silent:
        broker = NatsBroker.from_url(f"nats://127.0.0.1:{silent.port}?connect_timeout=1")
        assert "client port" in str(await refused_start(broker, within=4))


async def _listening(port: int) -> bool:
    """True once a server accepts connections on ``port`` (a refused start fails at once)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def test_start_on_a_server_without_jetstream_says_so() -> None:
    """A plain nats-server (no ``-js``): ``start`` fails within ``connect_timeout`` and the
    error says to enable JetStream."""
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        find_nats_server(),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await eventually(lambda: _listening(port), message="nats-server listening")
        broker = NatsBroker.from_url(f"nats://127.0.0.1:{port}?connect_timeout=1")
        error = await refused_start(broker, within=4)
        assert "JetStream" in str(error) and "-js" in str(error)
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 10)


async def test_a_kafka_url_at_the_nats_port_fails_fast(nats_url: str) -> None:
    """A user who points ``kafka://`` at a NATS port learns it in ``connect_timeout``: the
    server answers, but not as a Kafka broker."""
    host = urlsplit(nats_url).netloc
    broker = KafkaBroker.from_url(f"kafka://{host}?connect_timeout=2")
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        with pytest.raises(BrokerError, match="not as a Kafka broker"):
            await asyncio.wait_for(broker.start(), 20)
    finally:
        await broker.close()
    assert loop.time() - began < 5


# -- the duplicate window ----------------------------------------------------------------------


async def test_a_repeated_send_id_is_stored_once_within_the_duplicate_window(
    nats_url: str,
) -> None:
    """The other side of the contract's re-send test: a publish repeated with the same
    ``eventflow-id`` (a retried ambiguous publish) is stored once, and so is one repeated
    with the same ``eventflow-send-id`` (a retried replay); a new send id is a new message."""
    config = NatsBrokerConfig.from_url(f"{nats_url}?stream=EF_CONTRACT&storage=memory")
    async with NatsBroker(config) as broker:
        topic, group = f"{unique_name()}.dup", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        envelope_id, send_id = unique_name("id"), unique_name("send")
        plain = {MESSAGE_ID_HEADER: envelope_id}
        replay = {MESSAGE_ID_HEADER: envelope_id, SEND_ID_HEADER: send_id}
        for headers, text in [(plain, "original"), (plain, "retry"), (replay, "replay")]:
            await broker.publish(topic, text.encode(), key="k", headers=headers)
        await broker.publish(topic, b"replay retried", key="k", headers=replay)
        await broker.publish(topic, b"after", key="k")
        got = await collect(sub, 3)
        assert [d.payload for d in got] == [b"original", b"replay", b"after"]
        assert await drain(sub, 0.5) == []


# -- refusals ------------------------------------------------------------------------------------


@pytest.fixture
async def contract_broker(nats_url: str) -> AsyncIterator[NatsBroker]:
    """A started broker on the contract's stream (short publish timeout)."""
    broker = NatsBroker.from_url(f"{nats_url}?stream=EF_CONTRACT&storage=memory&publish_timeout=2")
    await broker.start()
    try:
        yield broker
    finally:
        await broker.close()


async def test_headers_count_towards_the_servers_max_payload(contract_broker: NatsBroker) -> None:
    """A payload under ``max_payload`` whose headers take it over is refused before it is
    sent (the server would drop the connection), and the connection stays up."""
    broker = contract_broker
    topic, group = f"{unique_name()}.hdr", unique_name("g")
    sub = await broker.subscribe(topic, group=group)
    nc = broker._connection()
    payload = b"x" * (nc.max_payload - 50)
    with pytest.raises(MessageRefusedError, match="max_payload"):
        await broker.publish(topic, payload, key="k", headers={"x-pad": "y" * 100})
    await broker.publish(topic, b"fine", key="k")
    got = await collect(sub, 1)
    assert [d.payload for d in got] == [b"fine"]
    assert nc.stats["reconnects"] == 0, "the server did not see the oversized message"


@pytest.fixture
async def own_stream(nats_url: str) -> AsyncIterator[tuple[str, nats.NATS]]:
    """A fresh stream name and a plain client to set it up and inspect it; deleted after."""
    stream = unique_name("EF").upper()
    nc = await nats.connect(nats_url)
    try:
        yield stream, nc
    finally:
        js = nc.jetstream()
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(stream)
        for bucket in (f"{stream}_leases", f"{stream}_releases"):
            with contextlib.suppress(NotFoundError):
                await js.delete_key_value(bucket)
        await nc.close()


async def test_a_message_jetstream_refuses_raises_message_refused(
    nats_url: str, own_stream: tuple[str, nats.NATS]
) -> None:
    """A stream whose ``max_msg_size`` a message exceeds refuses it for good (an API error
    400): ``MessageRefusedError`` at once, not retried; the next message is stored."""
    stream, nc = own_stream
    await nc.jetstream().add_stream(
        StreamConfig(
            name=stream,
            subjects=[f"{stream.lower()}.>"],
            max_msg_size=1000,
            storage=StorageType.MEMORY,
        )
    )
    broker = NatsBroker.from_url(f"{nats_url}?stream={stream}&storage=memory&publish_timeout=5")
    await broker.start()
    try:
        topic, group = f"{unique_name()}.small", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(MessageRefusedError, match="max_msg_size"):
            await broker.publish(topic, b"x" * 2000, key="k")
        assert loop.time() - began < 1, "a refusal is not retried until publish_timeout"
        await broker.publish(topic, b"fits", key="k")
        assert [d.payload for d in await collect(sub, 1)] == [b"fits"]
    finally:
        await broker.close()


async def test_a_full_stream_is_backpressure_not_a_refusal(
    nats_url: str, own_stream: tuple[str, nats.NATS]
) -> None:
    """``maximum messages exceeded`` (503) may pass: retried until ``publish_timeout``, then
    ``BackpressureError``, never ``MessageRefusedError``."""
    stream, _ = own_stream
    broker = NatsBroker.from_url(
        f"{nats_url}?stream={stream}&storage=memory&max_msgs=1&publish_timeout=0.5"
    )
    await broker.start()
    try:
        topic = f"{unique_name()}.full"
        await broker.publish(topic, b"one", key="k")
        with pytest.raises(BackpressureError, match="full"):
            await broker.publish(topic, b"two", key="k")
    finally:
        await broker.close()


# -- consumers: no server-side delivery limit ---------------------------------------------------


async def _max_delivers(nc: nats.NATS, stream: str, group: str, pattern: str) -> set[int]:
    js = nc.jetstream()
    gid = group_id(group, pattern)
    infos = [await js.consumer_info(stream, consumer_name(gid, p)) for p in range(2)]
    return {info.config.max_deliver for info in infos if info.config.max_deliver is not None}


def test_max_deliver_defaults_to_no_limit() -> None:
    """``max_deliver`` is -1 (no limit) unless set; a limit must be at least 2."""
    assert NatsBrokerConfig().max_deliver == -1
    assert NatsBrokerConfig.from_url("nats://h:4222?max_deliver=-1").max_deliver == -1
    assert NatsBrokerConfig(max_deliver=100).max_deliver == 100


async def test_group_consumers_get_no_server_side_delivery_limit(
    nats_url: str, own_stream: tuple[str, nats.NATS]
) -> None:
    """The consumer counts attempts itself, so the server must never stop redelivering: the
    durable consumers are created with ``max_deliver=-1``, and those an older version made
    with a limit are updated when a group subscribes again."""
    stream, nc = own_stream
    topic = f"{unique_name()}.md"
    old = NatsBroker.from_url(
        f"{nats_url}?stream={stream}&storage=memory&partitions=2&max_deliver=50"
    )
    await old.start()
    try:
        await (await old.subscribe(topic, group="billing")).close()
        assert await _max_delivers(nc, stream, "billing", topic) == {50}
    finally:
        await old.close()
    new = NatsBroker.from_url(f"{nats_url}?stream={stream}&storage=memory&partitions=2")
    await new.start()
    try:
        await (await new.subscribe(topic, group="billing")).close()
        assert await _max_delivers(nc, stream, "billing", topic) == {-1}
        await (await new.subscribe(topic, group="shipping")).close()
        assert await _max_delivers(nc, stream, "shipping", topic) == {-1}
    finally:
        await new.close()


# -- supervision -------------------------------------------------------------------------------


async def test_group_coordination_runs_under_the_given_supervisor(nats_url: str) -> None:
    """``start(supervisor)``: each subscription's coordinator is a component of the app's
    supervisor, running while the subscription lives and stopped by its ``close``."""
    supervisor = Supervisor("app")
    broker = NatsBroker.from_url(f"{nats_url}?stream=EF_CONTRACT&storage=memory")
    await broker.start(supervisor)
    try:
        topic, group = f"{unique_name()}.sv", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        [component] = supervisor.components
        assert group in component.name and component.state is ComponentState.RUNNING
        await broker.publish(topic, b"m", key="k")
        assert [d.payload for d in await collect(sub, 1)] == [b"m"]
        await sub.close()
        assert component.state is ComponentState.STOPPED
    finally:
        await broker.close()
        await supervisor.close()


async def test_a_subject_the_user_may_not_publish_to_is_refused(tmp_path: Path) -> None:
    """A permissions violation gets no reply (the server tells the client's error callback):
    the publish is refused for good within the request timeout, not retried until
    ``publish_timeout`` as if the server were down, and the next one is refused at once."""
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f'port: {port}\nhost: 127.0.0.1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'authorization { users = [ { user: "app", password: "pw", permissions: '
        '{ publish: { allow: [">"], deny: ["*.*.secret.>"] } } } ] }\n'
    )
    server = await asyncio.create_subprocess_exec(
        find_nats_server(),
        "-c",
        str(conf),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await eventually(lambda: _listening(port), message="nats-server listening")
        url = (
            f"nats://app:pw@127.0.0.1:{port}?stream={unique_name('PERM').upper()}"
            "&request_timeout=1&publish_timeout=30&connect_timeout=10"
        )
        async with NatsBroker.from_url(url) as broker:
            await broker.publish("open.x", b"{}")
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(MessageRefusedError, match="permissions violation"):
                await broker.publish("secret.x", b"{}")
            assert loop.time() - began < 5  # the request timeout, not publish_timeout
            began = loop.time()
            with pytest.raises(MessageRefusedError):
                await broker.publish("secret.x", b"{}")
            assert loop.time() - began < 0.5
            await broker.publish("open.y", b"{}")  # the broker goes on
    finally:
        server.terminate()
        await server.wait()


async def test_lag_raises_broker_error_while_the_server_is_gone() -> None:
    """``lag`` asks the server at each call: with the server killed it raises a
    ``BrokerError`` within ``request_timeout`` (no stale answer), and answers again once
    the server is back."""
    with NatsServer() as server:
        config = NatsBrokerConfig.from_url(f"{server.url}?stream=EF_LAG&request_timeout=1")
        async with NatsBroker(config) as broker:
            topic, group = f"{unique_name()}.lag", unique_name("g")
            await broker.declare(topic, group=group)
            await broker.publish(topic, b"m", key="k")
            assert (await broker.lag(topic, group=group)).messages == 1
            server.kill()
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(BrokerError, match="lag"):
                await broker.lag(topic, group=group)
            assert loop.time() - began < 5
            server.start()  # file storage: the stream and the consumers are still there

            async def answers() -> bool:
                with contextlib.suppress(BrokerError):
                    return (await broker.lag(topic, group=group)).messages == 1
                return False

            await eventually(answers, timeout=15, message="lag answered after the restart")
