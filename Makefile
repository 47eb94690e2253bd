# Two entry points (see README "Quick start"). Both create .venv on first use.
.PHONY: demo test setup bench

setup:
	bash scripts/setup_env.sh

demo: setup
	.venv/bin/deltasync demo

test: setup
	bash scripts/run_tests.sh

bench: setup
	.venv/bin/deltasync bench --preset small
