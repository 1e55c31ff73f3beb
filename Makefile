# Shortcuts; the scripts are the source of truth (and work without make).
.PHONY: demo test soak bench fuzz

demo:   ## the main job on the bundled example
	bash scripts/demo.sh

test:   ## every test (short reliability runs included), lint and types
	bash scripts/test.sh

soak:   ## the reliability suites at full length, printing their figures
	bash scripts/test.sh -m soak --soak -s -q --timeout 7200

fuzz:   ## coverage-guided fuzzing (atheris) of the parsers and the builder, bounded; crash inputs land in .fuzz/
	bash scripts/bootstrap.sh dev
	mkdir -p .fuzz
	.venv/bin/python -m tests.fuzz_atheris -runs=$(or $(FUZZ_RUNS),1000000) -max_total_time=$(or $(FUZZ_SECONDS),120) -artifact_prefix=.fuzz/

bench:  ## every benchmark, printing ratios against floors measured in the same run
	for b in bench_render hook_sidecar discovery_scale plugin_device node_agent dra_prepare; do .venv/bin/python -m bench.$$b || exit 1; done
