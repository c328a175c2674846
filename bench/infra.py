"""The harness's product-side plumbing: per-figure names, topics, Redis prefixes, worker processes.

The generic parts (the stack, child processes, cleanup, CPU accounting) are in `deploy/harness.py`
and `deploy/host.py`. Everything a figure starts is registered with a `Cleanup` and undone in
reverse order, on success, on failure and on Ctrl-C (SIGINT/SIGTERM become KeyboardInterrupt in
the main thread): worker processes are stopped (SIGTERM, then SIGKILL), Redis keys under the
run's prefixes unlinked, the run's topics and consumer groups deleted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from kafka.admin import ConfigResource, ConfigResourceType

from deploy.harness import Cleanup, Proc, Stack, free_port, start_python, unlink_matching
from milpa_sessions.settings import Settings
from producers.topics import admin_client, delete_topics, describe_group, ensure_topics
from projections.redis_store import RedisProjectionStore
from schemas.errors import LogError
from session_model.signing import Signer

# Faust reads these from the environment; a dead member must not hold a partition for a minute.
FAST_GROUP_ENV = {
    "BROKER_SESSION_TIMEOUT": "6",
    "BROKER_HEARTBEAT_INTERVAL": "1",
    "BROKER_REBALANCE_TIMEOUT": "20",
}


def figure_settings(
    stack: Stack, tag: str, name: str, *, cluster: bool = False, **changes: Any
) -> Settings:
    """Settings (the product's defaults) with this figure's own topics, group and key prefix;
    topics replicated as the stack's brokers ask; with `cluster`, the projections on the stack's
    Redis Cluster (`MILPA_REDIS_CLUSTER`)."""
    base = f"bench-{tag}-{name}"
    if cluster and stack.redis_cluster_url is None:
        raise RuntimeError(f"the stack ({stack.source}) has no Redis Cluster")
    s = Settings(
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=stack.redis_cluster_url
        if cluster and stack.redis_cluster_url
        else stack.redis_url,
        redis_cluster=cluster,
        replication_factor=stack.replication_factor,
        min_insync_replicas=stack.min_insync_replicas,
        redis_prefix=f"bench{tag}{name}",
        events_topic=f"{base}-events",
        decisions_topic=f"{base}-decisions",
        questions_topic=f"{base}-questions",
        deadletter_topic=f"{base}-deadletter",
        snapshots_topic=f"{base}-snapshots",
        consumer_group=f"{base}-group",
    )
    return replace(s, **changes)


def create_topics(settings: Settings, cleanup: Cleanup) -> None:
    """Create the figure's topics; delete them (and its group's internal topics) at cleanup."""
    ensure_topics(settings)
    cleanup.push(f"delete topics of {settings.events_topic}", lambda: delete_topics(settings))


def stamp_on_append(settings: Settings) -> None:
    """Have the broker stamp the events topic's records with their append time (LogAppendTime),
    so that the worker's lag histograms time a batch from the broker's append, not from the
    producer's send (which the producer's linger and the send itself precede)."""
    admin = admin_client(settings)
    try:
        resource = ConfigResource(
            ConfigResourceType.TOPIC,
            settings.events_topic,
            configs={"message.timestamp.type": "LogAppendTime"},
        )
        result = admin.alter_configs([resource])
    finally:
        admin.close()
    outcome = result.get("topic", {}).get(settings.events_topic)
    if outcome != "OK":  # kafka-python returns a refusal (an ACL, a policy) instead of raising it
        raise LogError(f"{settings.events_topic}: LogAppendTime was refused: {outcome}")


def register_prefix(settings: Settings, cleanup: Cleanup) -> None:
    """Clear the figure's Redis keys at cleanup (on a Redis Cluster, on every master)."""
    cleanup.push(f"clear redis prefix {settings.redis_prefix}", lambda: clear_prefix(settings))


def clear_prefix(settings: Settings) -> None:
    """Clear these settings' Redis keys now (on a Redis Cluster, on every master)."""
    if settings.redis_cluster:
        _clear(settings)
    else:
        unlink_matching(settings.redis_url, settings.redis_keys().pattern())


def _clear(settings: Settings) -> None:
    client = settings.redis_sync()
    try:
        RedisProjectionStore(client, settings.redis_keys()).clear()  # a SCAN of every master
    finally:
        client.close()


def start_worker(
    cleanup: Cleanup,
    workdir: Path,
    name: str,
    settings: Settings,
    *,
    module: str = "milpa_sessions.cli",
    loglevel: str = "info",
    metrics: bool = True,
    command: str = "worker",
) -> Proc:
    """Start `python -m <module> <command>` with the settings in its environment; stop it at
    cleanup.

    The working directory is `workdir/name`, a scratch directory, so Faust's `<app>-data`
    directory does not land in the repository.
    """
    port = free_port() if metrics else 0
    if metrics:
        settings = replace(settings, metrics_port=port)
    cwd = workdir / name
    cwd.mkdir(parents=True, exist_ok=True)
    p = start_python(
        name,
        module,
        [command, "--loglevel", loglevel],
        cwd / "worker.log",
        env={**settings.to_env(), **FAST_GROUP_ENV},
        cwd=cwd,
        new_session=True,  # Ctrl-C in the terminal reaches the harness only
        metrics_port=port,
    )
    cleanup.push(f"stop worker {name} (pid {p.pid})", p.stop)
    return p


def watch_group(
    settings: Settings, group: str, topic: str, members: int
) -> tuple[dict[str, Any], threading.Event]:
    """A thread that notes when `group` is stable with `members` members each owning partitions.

    In the dict it returns: `stable_at` (time.monotonic()) and `assignment` (how many partitions of
    `topic` each member owns, sorted). Setting the event stops it.
    """
    out: dict[str, Any] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                group_now = describe_group(settings, group)
                state = group_now.state
                assigned = [m.partitions.get(topic, frozenset()) for m in group_now.members]
            except Exception:  # the group may not exist yet
                state, assigned = "", []
            if state == "Stable" and len(assigned) == members and all(assigned):
                out["stable_at"] = time.monotonic()
                out["assignment"] = sorted(len(p) for p in assigned)
                return
            stop.wait(0.2)

    threading.Thread(target=watch, daemon=True).start()
    return out, stop


def trusted_keys_dir(workdir: Path, signer: Signer) -> Path:
    """A directory holding `signer`'s public key as the workers' trusted keys (made once)."""
    directory = workdir / "trusted-keys"
    pem = directory / f"{signer.key_id}.pem"
    if not pem.exists():
        directory.mkdir(parents=True, exist_ok=True)
        pem.write_bytes(
            signer.private_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return directory
