# The two commands of the README. Both set up what is missing first (idempotent).
# `make test` runs three lanes: the suite on the local stack, the pipeline's tests with
# Apicurio Registry as the external registry (infra/apicurio_lane.py), and the state model's
# tests on a Redis Cluster (infra/redis_cluster_lane.py).
.PHONY: setup demo test bench

setup:
	@bash infra/setup.sh

demo: setup
	.venv/bin/choreo demo

test: setup
	.venv/bin/choreo stack start
	.venv/bin/python -m pytest -q
	.venv/bin/python -m infra.apicurio_lane
	.venv/bin/python -m infra.redis_cluster_lane

# the pipeline benchmark as bench/README.md quotes it (≈ 3 min); figures in bench/results/
BENCH_ARGS ?= --deliveries 2000 --repeats 3 --rates 100 --out bench/results/pipeline.json
bench: setup
	.venv/bin/python -m bench.pipeline $(BENCH_ARGS)
