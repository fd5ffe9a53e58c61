# The two entry points of README.md. Both install what is missing, build incrementally, then
# run their job; running them again on a set-up machine is quick.
.PHONY: demo test setup build check compose-up compose-down bench-meta bench-gateway bench-dataplane bench-matrix bench-movr

demo: build
	./target/debug/pgmr demo --global --nodes 9

test: build
	scripts/test.sh

setup:
	scripts/setup.sh

build: setup
	scripts/build.sh

# The docker-compose demo: 3 regions x 3 nodes and the MovR workload (docker/).
compose-up: build
	cargo build --release -p pgmr
	PGMR_BIN=target/release/pgmr scripts/compose.sh up

compose-down:
	scripts/compose.sh down

# Lints (not part of `make test`; run before pushing).
check:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Benchmarks (not part of `make test`): print medians and p99s; see bench/.
bench-meta: build
	cargo bench -p pgmr --bench meta

bench-dataplane: build
	cargo bench -p pgmr --bench dataplane

bench-matrix: build
	cargo bench -p pgmr --bench matrix

bench-movr: build
	cargo build --release -p pgmr
	{ [ -x target/venv-apps/bin/python ] || python3 -m venv target/venv-apps; } && \
	  target/venv-apps/bin/pip install -q --disable-pip-version-check 'psycopg2-binary>=2.9'
	target/venv-apps/bin/python bench/movr.py --pgmr target/release/pgmr

bench-gateway: build
	cargo build --release -p pgmr
	python3 bench/gateway.py --pgmr target/release/pgmr
