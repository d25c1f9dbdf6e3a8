# The two commands of the README. Both set up what is missing first (idempotent).
.PHONY: setup demo test bench

setup:
	@bash infra/setup.sh

demo: setup
	.venv/bin/choreo demo

test: setup
	.venv/bin/choreo stack start
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/choreo bench
