"""deploy/stack.py's pure parts for --brokers 3 and --redis-cluster: the nodes' properties, the
env file, the refusals. Nothing is started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy import stack
from deploy.stack import Paths, cluster_properties, env_lines, kafka_properties, redis_fields

PORTS = [(9101, 9201), (9102, 9202), (9103, 9203)]


def _props(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_the_single_node_keeps_its_properties() -> None:
    props = _props(kafka_properties(9092, 9093, Path("/d"), "4.3.1"))
    assert props == {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": "1@127.0.0.1:9093",
        "listeners": "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093",
        "advertised.listeners": "PLAINTEXT://127.0.0.1:9092",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "num.partitions": "6",
        "auto.create.topics.enable": "false",
        "log.dirs": "/d",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
    }


def test_three_nodes_form_one_quorum_and_replicate_everything_three_times() -> None:
    data = [Path(f"/s/kafka-{i}/data") for i in (1, 2, 3)]
    nodes = [_props(text) for text in cluster_properties(PORTS, data, "4.3.1")]
    voters = "1@127.0.0.1:9201,2@127.0.0.1:9202,3@127.0.0.1:9203"
    for i, (props, (port, cport)) in enumerate(zip(nodes, PORTS, strict=True), 1):
        assert props["node.id"] == str(i)
        assert props["process.roles"] == "broker,controller"
        assert props["controller.quorum.voters"] == voters
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}"
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{port}"
        assert props["log.dirs"] == str(data[i - 1])
        assert props["default.replication.factor"] == "3"
        assert props["min.insync.replicas"] == "2"
        assert props["offsets.topic.replication.factor"] == "3"
        assert props["transaction.state.log.replication.factor"] == "3"
        assert props["transaction.state.log.min.isr"] == "2"
        assert props["share.coordinator.state.topic.replication.factor"] == "3"
        assert props["share.coordinator.state.topic.min.isr"] == "2"
        assert props["auto.create.topics.enable"] == "false"
        assert int(props["broker.session.timeout.ms"]) > int(props["broker.heartbeat.interval.ms"])
    # Kafka 3.x has no share coordinator.
    old = _props(cluster_properties(PORTS, data, "3.9.1")[0])
    assert "share.coordinator.state.topic.replication.factor" not in old
    with pytest.raises(ValueError, match="one"):
        cluster_properties(PORTS, data[:2], "4.3.1")


def _state(tmp_path: Path, kafka: dict[str, object], redis_cluster: bool = False) -> Paths:
    p = Paths(tmp_path)
    p.kafka_json.write_text(json.dumps(kafka))
    p.redis_json.write_text(json.dumps({"port": 6390, "secure": False}))
    if redis_cluster:
        nodes = [{"index": i, "port": 7000 + i, "bus_port": 17000 + i} for i in range(1, 7)]
        p.redis_cluster_json.write_text(json.dumps({"nodes": nodes, "replicas": 1}))
    return p


def test_the_env_of_a_cluster_lists_every_broker_and_the_topic_settings(tmp_path: Path) -> None:
    nodes = [
        {"node_id": i, "port": port, "controller_port": cport}
        for i, (port, cport) in enumerate(PORTS, 1)
    ]
    kafka = {"version": "4.3.1", "nodes": nodes, "replication_factor": 3, "min_insync_replicas": 2}
    p = _state(tmp_path, kafka, redis_cluster=True)
    assert env_lines(p, redis_cluster=True) == [
        "MILPA_KAFKA_BOOTSTRAP=127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103",
        "MILPA_REDIS_URL=redis://127.0.0.1:6390/0",
        "MILPA_REPLICATION_FACTOR=3",
        "MILPA_MIN_INSYNC_REPLICAS=2",
        "MILPA_REDIS_CLUSTER_URLS="
        + ",".join(f"redis://127.0.0.1:{7000 + i}" for i in range(1, 7)),
    ]
    assert [node.label for node, _ in stack.kafka_layout(p)] == ["kafka-1", "kafka-2", "kafka-3"]
    assert all(st.state == "down" for _, st in stack.kafka_layout(p))


def test_the_env_of_a_single_node_is_as_before(tmp_path: Path) -> None:
    p = _state(tmp_path, {"version": "4.3.1", "port": 9092, "controller_port": 9093})
    assert env_lines(p) == [
        "MILPA_KAFKA_BOOTSTRAP=127.0.0.1:9092",
        "MILPA_REDIS_URL=redis://127.0.0.1:6390/0",
    ]
    assert [node.label for node, _ in stack.kafka_layout(p)] == ["kafka"]


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--secure", "--brokers", "3"],
        ["up", "--secure", "--redis-cluster"],
        ["kill-broker"],
        ["start-redis-node"],
        ["kill-broker", "1"],  # no cluster in the state dir
    ],
)
def test_what_cannot_be_done_exits_with_2_before_starting_anything(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stack.main([*argv, "--state-dir", str(tmp_path)]) == 2
    assert "stack: error:" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.pid"))


def test_only_one_or_three_brokers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        stack.main(["up", "--brokers", "2"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_replies_are_read_as_fields() -> None:
    reply = "# Replication\r\nrole:slave\r\nmaster_link_status:up\r\n"
    assert redis_fields(reply) == {"role": "slave", "master_link_status": "up"}
    assert redis_fields(None) == {}


class _Running:
    """A started process that keeps running."""

    pid = 0

    def poll(self) -> None:
        return None


def test_a_broker_is_ready_when_its_marker_was_logged_however_much_came_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow poll reads the marker and the hundreds of lines a broker logs after it in one chunk.
    log = tmp_path / "kafka-3.log"
    log.write_text("old run\n" + stack.KAFKA_READY_MARKER + "\n")  # before this start: ignored
    offset = log.stat().st_size
    with log.open("a") as fh:
        fh.write("starting\n" + stack.KAFKA_READY_MARKER + " (kafka.server)\n")
        fh.write("INFO unloading metadata for __consumer_offsets-1\n" * 400)
    node = stack.KafkaNode(3, "kafka-3", tmp_path / "kafka-3.pid", log, tmp_path / "kafka-3")
    monkeypatch.setattr(stack, "port_open", lambda port: True)
    monkeypatch.setattr(stack, "stop_pid", lambda *args: None)  # on failure: nothing to stop
    starting = [stack._Starting(node, _Running(), 9092, offset)]  # type: ignore[arg-type]
    assert [s.state for s in stack._wait_ready(starting, 0.0, timeout=2)] == ["up"]


def test_a_broker_that_never_logs_its_marker_is_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "kafka-3.log"
    log.write_text(stack.KAFKA_READY_MARKER + "\n")  # only from an earlier run
    node = stack.KafkaNode(3, "kafka-3", tmp_path / "kafka-3.pid", log, tmp_path / "kafka-3")
    monkeypatch.setattr(stack, "port_open", lambda port: True)
    monkeypatch.setattr(stack, "stop_pid", lambda *args: None)
    starting = [stack._Starting(node, _Running(), 9092, log.stat().st_size)]  # type: ignore[arg-type]
    with pytest.raises(stack.StackError, match="not ready"):
        stack._wait_ready(starting, 0.0, timeout=0.3)
