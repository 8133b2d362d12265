# gpusnap -- see README.md. Targets run as root on Debian 12 unless noted.
SHELL := /bin/bash
PY ?= python3
VENV := /opt/gpusnap/venv
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: deps install uninstall demo-image demo test test-matrix unit integration gpu-bundle bench clean

deps:            ## system packages, CRIU 4, host config (idempotent)
	bash packaging/deps.sh

install: deps    ## the package, the OCI hook, the CRIU action script
	bash packaging/install.sh

demo-image: deps
	sh packaging/demo-image.sh

demo: install demo-image  ## checkpoint -> export -> restore a demo container (on a GPU when there is one)
	bash packaging/demo.sh

unit: install
	$(PYTEST) -q tests/unit

integration: install demo-image
	$(PYTEST) -q -m "not gpu and not cri" tests/integration

# A failed test runs once more, alone, and is counted ("retried: N", goal 0).
test: install demo-image  ## everything that runs without a GPU
	$(VENV)/bin/lint-imports --no-cache
	bash tests/retry-once.sh make-test .pytest_cache -m "not gpu and not cri" tests

test-matrix: install demo-image  ## integration tests under Podman 5 + crun/runc (Debian trixie, sid roots, cached), containerd 2.1 + shim + CRI (sid); MATRIX="sid:crun"
	bash tests/matrix/run.sh $(MATRIX)

gpu-bundle:      ## .deb files the bare GPU machine needs, into .gpu-bundle/ (run here, carried there)
	bash tests/gpu/make-bundle.sh .gpu-bundle

bench: install demo-image  ## checkpoint bench, then the migration bench: ends with its `speedup X.XX`
	set -o pipefail; $(VENV)/bin/python bench/checkpoint_bench.py | sed -u 's/^speedup /checkpoint speedup /'
	$(VENV)/bin/python bench/migrate.py

.PHONY: bench-migrate
bench-migrate: install demo-image  ## container -> registry -> restored: plain podman + oras against gpusnap
	$(VENV)/bin/python bench/migrate.py

.PHONY: bench-registry
bench-registry: install demo-image  ## container -> registry -> archive: gpusnap against podman export + oras
	$(VENV)/bin/python bench/registry_bench.py

clean:
	rm -rf build dist *.egg-info .pytest_cache
