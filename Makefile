# The two set-up commands of the README. Both create the venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BROWSER := $(VENV)/.browser

.PHONY: demo test test-unit test-slow bench chaos chaos-network gpu-check scale clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The dashboard's browser test (tests/integration/test_dashboard.py, make test-slow) drives
# Debian's chromium and chromium-driver. They are installed where the machine
# allows (root with apt-get); elsewhere that test skips with one line.
$(BROWSER): $(STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -qq chromium chromium-driver || \
	      { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }; } >/dev/null 2>&1; } || \
	  echo "no chromium installed here: the dashboard's browser test will skip"
	touch $(BROWSER)

demo: $(STAMP)
	$(PY) -m schedules demo
	@echo "--- tiny, P=4, on 6 local nodes (agents) in zones a,b,c: a pipeline, two nodes released;"
	@echo "--- node 2 (agent and worker) is SIGKILLed in iteration 15 ---"
	$(VENV)/bin/bamboo-train --model tiny --stages 4 --microbatches 8 --iterations 30 \
		--local-nodes 6 --zones a,b,c --preempt 2@15:10 --metrics-out out/metrics.jsonl
	@$(PY) -c "import json; [print(r['iteration'], e) for r in map(json.loads, open('out/metrics.jsonl')) \
		for e in r.get('events', [])]"

test: $(STAMP)
	$(PY) -m pytest -q

# The fast part while working: no processes, no etcd (the conftest.py of both refuses them).
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/architecture

test-slow: $(STAMP) $(BROWSER)
	$(PY) -m pytest -q -m slow

chaos: $(STAMP)
	$(VENV)/bin/bamboo-chaos --trials 50 --seed 1 --faults 4

chaos-network: $(STAMP)
	$(VENV)/bin/bamboo-chaos --network --trials 30 --seed 1

gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

bench: $(STAMP)
	$(PY) scripts/bench_schedules.py

# The control plane at fleet scale: emulated nodes against one real etcd (docs/performance.md).
scale: $(STAMP)
	mkdir -p out
	$(VENV)/bin/bamboo-scale --nodes 10,100,300,1000 --json out/scale.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis out
