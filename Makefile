# The two set-up commands of the README. Both create the venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m schedules demo
	@echo "--- training tiny on P=4 stages; node 2 is SIGKILLed in iteration 15 ---"
	$(VENV)/bin/bamboo-train --model tiny --stages 4 --microbatches 8 --iterations 30 \
		--preempt 2@15:20 --metrics-out out/metrics.jsonl
	@grep -h '"preemption"' out/metrics.jsonl | head -1

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) scripts/bench_schedules.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis out
