# Two commands on a fresh machine (see README):
#   make run    install, then run the main job on the embedded default (local launcher)
#   make test   install what the tests need, start the local Slurm cluster, run the suite
VENV := .venv
GYRE := $(VENV)/bin/gyre-hpc
CONFIG ?= examples/local.yaml
NODES ?= 4
PYTEST_ARGS ?=

.PHONY: run test quicktest install install-test install-system install-mpi

install:
	scripts/install-python.sh

install-test:
	scripts/install-python.sh test

install-system:
	scripts/install-system.sh

install-mpi:
	scripts/install-system.sh mpi

run: install-mpi install
	$(GYRE) run $(CONFIG)

# The whole suite, Slurm and vLLM included. GYRE_REQUIRE_SLURM / _MPI / _VLLM / _CHROMIUM / _SMOLLM2 / _MINISWE turn "not
# available" skips into failures so CI can never pass by skipping those tests.
# The cluster is stopped afterwards only if this run started it: a cluster that was already
# up (someone else's session, a second checkout) keeps running.
test: install-system install-test
	@out=$$($(GYRE) cluster up --nodes $(NODES)) || { echo "$$out"; exit 1; }; echo "$$out"; \
	  started=0; case "$$out" in "cluster started"*) started=1;; esac; \
	  GYRE_REQUIRE_SLURM=1 GYRE_REQUIRE_MPI=1 GYRE_REQUIRE_VLLM=1 GYRE_REQUIRE_CHROMIUM=1 GYRE_REQUIRE_SMOLLM2=1 GYRE_REQUIRE_MINISWE=1 $(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS); rc=$$?; \
	  if [ $$started = 1 ]; then $(GYRE) cluster down; fi; exit $$rc

# The quick local loop: no Slurm, no slow tests.
quicktest: install-test
	$(VENV)/bin/python -m pytest -m "not slurm and not slow" -q $(PYTEST_ARGS)
