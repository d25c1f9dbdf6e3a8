"""The third test lane: the state model's tests on a Redis Cluster.

Starts a cluster of three masters with a replica each (``infra.redis_cluster``) on ports of
its own, runs the pipeline, supervisor, rebuild, replay and admission tests with
``REDIS_URL`` at one of its nodes (``CHOREO_EXTERNAL=redis``: the stack starts no Redis of
its own; ``CHOREO_TEST_REDIS_CLUSTER``: the tests that keep a Redis of their own use the
cluster), stops it, and exits with pytest's code. ``make test`` runs it after the other
lanes: ``python -m infra.redis_cluster_lane [more pytest args]``.
"""

from __future__ import annotations

import os
import sys

from choreo.config import settings
from infra.lanes import run_pytest
from infra.process import StackError
from infra.redis_cluster import RedisCluster

# never the cluster ``choreo stack start --redis-cluster`` keeps on 7000-7005
BASE_PORT = int(os.environ.get("CLUSTER_LANE_PORT", "7100"))
TESTS = [f"tests/integration/{name}.py" for name in (
    "test_batch_scripts", "test_join_record", "test_pipeline", "test_supervisor", "test_release",
    "test_admission",
    "test_ops_replay", "test_ops_pipeline", "test_layout", "test_rolling_upgrade")]


def main(args: list[str]) -> int:
    cluster = RedisCluster(settings().data_dir / "cluster-lane", BASE_PORT)
    try:
        cluster.start()
    except StackError as exc:
        print(f"redis cluster lane: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    url = f"{cluster.url}/0"
    print(f"redis cluster lane: {len(cluster.ports)} nodes at {cluster.url}", file=sys.stderr)
    try:
        return run_pytest("redis", {"REDIS_URL": url, "CHOREO_TEST_REDIS_CLUSTER": url}, TESTS, args)
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
