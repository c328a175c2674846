"""`python -m bench.run [--quick] [--only NAME,...] [--topology single|cluster] [--out FILE]`

Starts or reuses the local stack (`deploy/stack.py up`; never stops it), measures every figure on
it, prints one JSON line per figure on stdout as soon as it is measured, then a table. Progress goes
to stderr. Figures: producer, projector (1 and 2 workers, naive baseline, Redis ceiling), replay,
e2e, expiry, memory. With `--topology cluster` it also starts or reuses a replicated stack (`up
--brokers 3 --redis-cluster` in `<state dir>-cluster`; never stops it) and measures the projector
and e2e figures on it too, each against its single-node figure of the same run. Exit status: 0
when every figure was measured (targets met or not), 1 when a figure failed, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.figures import FIGURES, ON_CLUSTER, STEPS, TOPOLOGIES, Run, Sizes, plan
from bench.figures.common import SETTLE_LIMIT_PCT, SETTLE_SAMPLE_S
from bench.stats import Figure, table
from deploy import harness
from deploy.host import describe_machine, git_state
from milpa_sessions.settings import Settings
from producers.settings import ENV_PREFIX

# What the figures depend on: an uncommitted file here goes with the run's description. The bench
# and the stack it starts count too (how a figure is measured changes the figure).
MEASURED_DIRS = (
    "schemas",
    "session_model",
    "projections",
    "producers",
    "processors",
    "milpa_sessions",
    "bench",
    "deploy",
)


# The distributions whose versions go with the figures.
DISTRIBUTIONS = (
    "faust-streaming",
    "mode-streaming",
    "aiokafka",
    "kafka-python",
    "redis",
    "hiredis",
    "fastavro",
)


PROTECTED = {
    "kafka_bootstrap",
    "redis_url",
    "redis_prefix",
    "events_topic",
    "decisions_topic",
    "questions_topic",
    "deadletter_topic",
    "snapshots_topic",
    "consumer_group",
    "metrics_port",
    # The topology's (--topology): where the projections live, how topics are replicated, and
    # what a projection write waits for.
    "redis_cluster",
    "replication_factor",
    "min_insync_replicas",
    "redis_wait_replicas",
}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`FIELD=VALUE` items as typed Settings fields (names and addresses stay the harness's)."""
    known = {f.name for f in fields(Settings)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in known:
            raise ValueError(
                f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(known)}"
            )
        if name in PROTECTED:
            raise ValueError(f"--set {name}: the harness chooses it (per figure)")
        parsed = Settings.from_env({f"{ENV_PREFIX}{name.upper()}": raw.strip()})
        out[name] = getattr(parsed, name)
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m bench.run` (and `./dev bench`)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about 3 minutes)")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated figures to run, of: {','.join(FIGURES)} (default: all)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="py-spy the 1-worker projector while it folds, the harness during replay, the "
        "expiry worker while it closes windows and the e2e worker at its paced rate; raw stacks "
        "and summaries go to DIR (profiled figures are perturbed a little and say so in their "
        "params)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a producers.settings.Settings field for every figure, e.g. "
        "--set batch_max_records=1000 (repeatable; the default is the product's defaults)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs")
    parser.add_argument(
        "--settle-max-s",
        type=float,
        default=60.0,
        metavar="S",
        help="before each figure, wait until the broker and Redis are at rest (each under "
        f"{SETTLE_LIMIT_PCT:g} %% of a core over a second), at most S seconds (default 60; 0: "
        "do not wait); the run's last line gives each wait",
    )
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="single",
        help="single: one broker and one Redis (default); cluster: also measure "
        f"{', '.join(ON_CLUSTER)} on 3 brokers (RF 3, min.insync.replicas 2) and a Redis Cluster "
        "(3 masters + 3 replicas), started or reused in <state dir>-cluster, each as a ratio to "
        "its single-node figure of the same run",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        ordered = plan([n.strip() for n in args.only.split(",") if n.strip()], args.topology)
    except ValueError as e:
        cli.error(str(e))

    def log(message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    out_file = args.out.open("w") if args.out else None
    figures: list[Figure] = []

    def write(line: str) -> None:
        print(line, flush=True)
        if out_file is not None:
            out_file.write(line + "\n")
            out_file.flush()

    def emit(figure: Figure) -> None:
        figures.append(figure)
        write(figure.json_line())

    harness.interrupt_on_sigterm()
    cleanup = harness.Cleanup(log)
    status = 0
    started = time.monotonic()
    try:
        stack = harness.ensure_stack(log)
        cluster = None
        if args.topology == "cluster":
            cluster = harness.ensure_cluster_stack(log)
        tag = uuid.uuid4().hex[:8]
        host = {"git": git_state(harness.REPO, MEASURED_DIRS), **describe_machine(DISTRIBUTIONS)}
        host["servers"] = harness.server_versions(stack)
        log(f"run {tag}: kafka {stack.kafka_bootstrap}, redis {stack.redis_url}; {host}")
        if cluster is not None:
            host["servers_cluster"] = harness.server_versions(cluster, harness.cluster_stack_dir())
            log(f"cluster: kafka {cluster.kafka_bootstrap}, redis {cluster.redis_cluster_url}")
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        workdir = harness.scratch_dir(cleanup, keep=args.keep_logs)
        if args.keep_logs:
            log(f"worker logs in {workdir}")
        run = Run(
            stack=stack,
            tag=tag,
            sizes=Sizes.quick() if args.quick else Sizes.full(),
            cleanup=cleanup,
            root=cleanup,
            workdir=workdir,
            log=log,
            emit=emit,
            profile_dir=args.profile,
            overrides=overrides,
            other_stack=cluster,
        )
        # The calibration goes first, in every run: the figures are read against it.
        settled: dict[str, dict[str, Any]] = {}
        for name in ordered:
            log(f"== {name}")
            if args.settle_max_s > 0:
                waited, servers = run.settle(args.settle_max_s)
                settled[name] = {"waited_s": round(waited, 1), "servers_cpu_pct": servers}
                if waited > 1.5 * SETTLE_SAMPLE_S:
                    log(f"   waited {waited:.1f}s for the servers to be at rest: {servers}")
            t = time.monotonic()
            try:
                with cleanup.scope() as scope:
                    run.cleanup = scope
                    STEPS[name](run)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                status = 1
                log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                emit(Figure(f"{name}_failed", None, "", error=f"{type(e).__name__}: {e}"))
            finally:
                run.cleanup = cleanup
            log(f"   {name} took {time.monotonic() - t:.0f}s")
        params = {
            "tag": tag,
            "quick": args.quick,
            "figures": ordered,
            "machine": host,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "settings_overrides": {k: str(v) for k, v in overrides.items()},
            "stack": stack.source,
            "topology": args.topology,
            "settled_before": settled,
        }
        if cluster is not None:
            params["stack_cluster"] = cluster.source
        # The run itself, in the figures' format (not a figure: not in the table).
        write(Figure("_run", round(time.monotonic() - started, 1), "s", params=params).json_line())
    except KeyboardInterrupt:
        log("interrupted: stopping workers and cleaning up")
        status = 130
    finally:
        cleanup.run()
        if out_file is not None:
            out_file.close()
    if figures:
        _print_table(figures)
    return status


def _print_table(figures: list[Figure]) -> None:
    """The figures for people, and which missed their target or were disturbed."""
    print()
    print(table(figures))
    unmet = [f.figure for f in figures if f.met is False]
    if unmet:
        print(f"\ntargets not met: {', '.join(unmet)}")
    disturbed = [f.figure for f in figures if "disturbed" in f.params]
    if disturbed:
        print(
            "disturbed (other processes used >= 20% of a core while measuring; see their "
            f"params): {', '.join(disturbed)}"
        )


if __name__ == "__main__":
    sys.exit(main())
