# Every target does the set-up it needs: a virtualenv in .venv, torch (CPU), the patched Horovod
# wheel (built once, cached in $(NIGHTSHIFT_CACHE)), and this project with its pinned dependencies.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
export NIGHTSHIFT_CACHE ?= $(HOME)/.cache/nightshift
STAMP := $(VENV)/.nightshift-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check
PYTEST_ARGS ?=

# Debian packages some integration tests need, as command:package: sshd (emulated hosts), redis-server
# (stream scoring), ip (network namespaces), nft (packet loss between emulated hosts), chromium and
# chromedriver (the browser tests), podman, buildah, runc and debootstrap (`make images`, the tests marked
# `images`), patch (the Horovod wheel's build). Installed when missing and running as root; otherwise those tests skip with a reason.
SYSTEM_PACKAGES := sshd:openssh-server redis-server:redis-server ip:iproute2 nft:nftables chromium:chromium \
	chromedriver:chromium-driver podman:podman buildah:buildah runc:runc debootstrap:debootstrap patch:patch

.PHONY: setup system-packages demo test test-fast airflow bench lint docs clean images constraints

setup: system-packages $(STAMP)

system-packages:
	@PATH="$$PATH:/usr/sbin:/sbin"; missing=""; \
	for pair in $(SYSTEM_PACKAGES); do \
		command -v "$${pair%%:*}" >/dev/null || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "apt-get install$$missing"; \
		apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y $$missing >/dev/null; \
	else \
		echo "note: not root, not installing Debian packages$$missing (the tests that need them skip)"; \
	fi

HOROVOD_BUILD := nightshift/horovod_build
$(STAMP): pyproject.toml constraints.txt $(HOROVOD_BUILD)/horovod-wheel.sh $(HOROVOD_BUILD)/horovod-0.28.1-elastic-join.patch
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "pip==26.3"
	$(PIP) install -q -c constraints.txt torch==2.13.0
	wheel="$$($(HOROVOD_BUILD)/horovod-wheel.sh $(BIN)/python)" && $(PIP) install -q "$$wheel" \
		&& $(PIP) install -q --no-deps --force-reinstall "$$wheel"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

# DEMO_ARGS: scripts/demo.py's options, e.g. DEMO_ARGS="--epochs 1" for a quicker demo (docs/getting-started.md).
DEMO_ARGS ?=
demo: setup
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

# pytest-xdist: TEST_WORKERS processes, each test module on one worker (`--dist loadfile`: its module fixtures
# start once), the longest modules first (tests/conftest.py). Most integration tests wait on I/O (Airflow, sshd,
# Redis), so 2 cores carry more workers than cores. TEST_WORKERS=0 runs the tests in this process.
# (Not `--dist loadgroup`: xdist 3.8 groups by rewriting item._nodeid, which pytest 9.2 no longer reads. And
# --no-loadscope-reorder: by default xdist queues the modules with the most tests first, which put the long
# integration modules, with few tests each, at the end of a run.)
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(XDIST) --durations=15 $(PYTEST_ARGS)

test-fast: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m "not integration and not slow" -n 2 \
		--dist loadfile --durations=15 $(PYTEST_ARGS)

# The trainer (CPU), serving and Airflow images, built with podman from images/*/Dockerfile on local
# equivalents of the official base images (scripts/images.py; docs/how-to/images.md).
# Layers are cached: a second run with nothing changed takes well under a minute.
# IMAGES_ARGS="--only trainer,serving" builds a subset.
IMAGES_ARGS ?=
images: system-packages
	$(PYTHON) scripts/images.py $(IMAGES_ARGS)

airflow: setup
	scripts/airflow.sh standalone

bench: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m bench

# constraints.txt from this venv, after a change of pyproject.toml's ranges was installed and tested: every
# package pip freeze lists, less this project (editable) and Horovod (the patched local build); torch without its
# local version label, so that the CPU (+cpu) and CUDA (+cu128) builds of that version both satisfy it.
constraints: setup
	{ sed -n '/^#/p' constraints.txt; $(PIP) freeze --exclude-editable \
		| grep -v -i -e '^horovod[= @]' -e '^nightshift[= @]' | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	set -o pipefail; $(MKDOCS) 2>&1 | { grep -v "^INFO" || true; }  # not --quiet: it hides the warnings strict counts

# The documentation site (mkdocs.yml, docs/), strictly: a broken link, a page missing from the nav or a reference
# page the generator cannot build (scripts/gen_reference.py) fails it. Into site/; `make lint` builds it too.
MKDOCS = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
docs: setup
	$(MKDOCS)

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
