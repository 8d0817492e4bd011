.PHONY: run test lint bench-forward

PROMPT ?= Write one sentence about caching.

# Install everything, then generate with the default model (SmolLM2-135M-Instruct).
run:
	bash scripts/install.sh
	.venv/bin/radixserve generate --chat "$(PROMPT)"

# Install what tests need, then run the whole suite: two workers (CI has two cores), each
# taking whole test files, so a file's shared servers and fixtures stay in one process.
test:
	bash scripts/install.sh --test
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25

lint:
	.venv/bin/ruff check radixserve radixserve_bench radixserve_kernels tests benchmarks

bench-forward:
	.venv/bin/python benchmarks/forward_micro.py
