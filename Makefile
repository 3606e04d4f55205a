# MARS — two commands: `make run` and `make test`. Everything installs from the package registries.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/mars/v1/*.proto)
PROTO_OUT := services/mars/v1/.generated

.PHONY: test-sharpness bytecode chart-acls install proto kafka litellm run test test-resilience test-unit test-integration lint clean image test-image kube test-k8s test-k8s-kubelet node-tools test-k8s-e2e

install: $(STAMP)

# llama-cpp-python (the local LLM server) compiles from source once (~6 min) into a wheel kept in
# .cache/wheels, built for any x86-64-v3 CPU (AVX2, FMA, F16C) rather than for the building CPU: the native
# build picked AVX-512/AMX kernels on a Xeon that has them and segfaulted on every prompt there, and pip's
# own cache would hand a wheel built for one CPU to a machine with another.
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python\[server\]==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
WHEELS := .cache/wheels
LLAMA_WHEEL := $(WHEELS)/.llama-cpp-python-$(LLAMA_VERSION)-x86-64-v3

$(LLAMA_WHEEL):
	mkdir -p $(WHEELS)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PYTHON) -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir $(WHEELS) \
		'llama-cpp-python==$(LLAMA_VERSION)'
	touch $@

$(STAMP): pyproject.toml $(LLAMA_WHEEL)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(PY) -m pip install --quiet -e '.[dev,local,deploy]'
	touch $@

proto: $(PROTO_OUT)

$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	rm -rf services/mars/v1
	mkdir -p services/mars/v1
	$(PY) -m grpc_tools.protoc -Iproto --python_out=services --grpc_python_out=services --pyi_out=services $(PROTO_SRC)
	touch services/mars/v1/__init__.py $@

# Apache Kafka's jars from Maven Central (cached in infra/kafka/target), the class archive its brokers start
# from (made once there by a throwaway broker, ~12 s on 2 cores), and the launcher that lets a broker's own JVM
# format its log dir (infra/kafka/launcher, compiled by the JDK's javac); without Java >= 17 the stack runs Tansu.
kafka: $(STAMP)
	@if $(PY) -c "import sys; from mars_stack.kafka import java_major; sys.exit(0 if (java_major() or 0) >= 17 else 1)"; then \
		$(PY) -c "from mars_stack.kafka import ensure_kafka_libs; print('Apache Kafka jars in', ensure_kafka_libs())"; \
		$(PY) -c "from mars_stack.kafka import ensure_class_archive; print('broker class archive:', ensure_class_archive())"; \
		$(PY) -c "from mars_stack.kafka import ensure_kafka_libs, ensure_launcher, local_java; \
			print('broker launcher:', ensure_launcher(local_java(), ensure_kafka_libs()) or 'none (no javac): a JVM of its own formats')"; \
	else echo "no Java >= 17: the local stack runs Tansu"; fi

# The LiteLLM proxy, the load harness's peer, in a virtual environment of its own (load-tests/load.py).
LITELLM_VENV := load-tests/.venv-litellm
litellm: $(LITELLM_VENV)/.installed

$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/python -m pip install --quiet 'litellm[proxy]==1.108.7'
	touch $@

run: install proto kafka
	$(VENV)/bin/mars run

# Every test but the resilience runs (processes killed and restarted, replicas, the short chaos run), which
# have their own target (.ci/run calls it right after this one): pytest -m "not resilience". Two xdist
# workers: one runs the tests that start local stacks, in order; the other the rest (tests/conftest.py).
test: install proto kafka litellm bytecode
	$(PY) -m pytest -q -m "not resilience" -n 2

# Our own modules compiled to bytecode once. Where PYTHONDONTWRITEBYTECODE is set (this machine and CI),
# Python reads __pycache__ but never writes it, so each service process, CLI run and harness compiled every
# module it imports again from source: about 0.3 s of CPU per process, and make test starts ~170 of them.
bytecode: install proto
	$(PY) -m compileall -q services infra load-tests/*.py

# The resilience runs: supervision (a killed process comes back on its port with its data), two replicas of
# every service, and chaos.py's short scenario (replicas SIGKILLed, the broker stopped, Postgres restarted).
test-resilience: install proto kafka bytecode
	$(PY) -m pytest -q -m resilience tests/integration

# Each check that issue 46 sharpened, shown failing on a deliberately broken copy of the repository
# (tests/sharpness/mutants.py): the unit and stack mutants, each test run on the unbroken copy first
# (~15 min on 2 cores). The chart's master-key mutant needs the control plane: add --cost k8s after make kube.
test-sharpness: install proto kafka litellm
	$(PY) tests/sharpness/check_mutants.py --cost unit,stack --baseline

# The chart's KafkaUser ACLs (charts/mars/files/kafka-acls.json) from mars.kafka_acls: the one table, written
# for the chart (tests/unit/test_kafka_acl_table.py fails when the file is stale).
chart-acls: install proto
	PYTHONPATH=services $(PY) -c "from mars.kafka_acls import chart_table_json; print(chart_table_json(), end='')" > charts/mars/files/kafka-acls.json

test-unit: install proto
	$(PY) -m pytest -q tests/unit

test-integration: install proto kafka
	$(PY) -m pytest -q tests/integration

# The local Kubernetes control plane (infra/k8s): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler v1.37 and kwok, built with Go from the module proxy into infra/k8s/bin (cold ~10 min on two
# cores, then a stamp check). `mars kube up` runs it; test-k8s installs the chart on it with Helm.
kube:
	infra/k8s/build.sh

test-k8s: install proto kube
	$(PY) -m pytest -q tests/k8s

# Past kwok: the upstream kubelet over Debian's containerd, runc and CNI plugins (installed when missing, as
# root) runs the chart's ingress pod in a container of the image (tests/k8s/test_real_kubelet.py). Builds
# the kubelet (~6 min cold) and the image (make image) first.
test-k8s-kubelet: install proto image node-tools
	infra/k8s/build.sh --kubelet
	$(PY) -m pytest -q tests/k8s/test_real_kubelet.py

# What a real node runs on, from Debian (as root, when missing): containerd, runc, the CNI plugins, and
# iptables and conntrack for kube-proxy.
node-tools:
	@if ! command -v containerd >/dev/null || ! command -v runc >/dev/null || [ ! -e /usr/lib/cni/bridge ] \
		|| ! command -v iptables >/dev/null || ! command -v conntrack >/dev/null; then \
		[ "$$(id -u)" = 0 ] || { echo "need root to apt-get install containerd runc containernetworking-plugins iptables conntrack" >&2; exit 2; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq containerd runc \
			containernetworking-plugins iptables conntrack >/dev/null; fi

# Turns answered inside Kubernetes (tests/k8s_e2e): the chart installed with Helm onto a real node (the
# kubelet over containerd, kube-proxy, CoreDNS, all built from the Go modules: build.sh --e2e, ~15 min cold,
# cached after), Kafka, Postgres and the stand-in LLM on the node's address behind Services; then turns
# through the ingress and gateway Services. Prints the figures at the end. Needs root.
test-k8s-e2e: install proto image node-tools
	infra/k8s/build.sh --e2e
	$(PY) -m pytest -q tests/k8s_e2e

# The services' OCI image (infra/image): a Debian bookworm base made by mmdebstrap, the wheels fetched here,
# built by podman with no network. Installs podman, buildah, mmdebstrap and runc from Debian when missing.
# Tagged localhost/mars:<version> and :latest (VARIANT=cuda: both with "-cuda"); IMAGE=name:tag for one name.
VARIANT ?= cpu
image: install proto
	$(if $(IMAGE),MARS_IMAGE=$(IMAGE)) VARIANT=$(VARIANT) PYTHON=$(abspath $(PY)) infra/image/build.sh

# The six services as podman containers (read-only, non-root) against the local Kafka, Postgres and LLM;
# builds the image itself (the same script, cached layers).
test-image: install proto kafka
	$(if $(IMAGE),MARS_IMAGE=$(IMAGE)) $(PY) -m pytest -q tests/image

# ruff, mypy, and the import contracts of .importlinter (layers, a pure domain, no cycles).
lint: install proto
	$(VENV)/bin/ruff check services infra tests load-tests
	$(VENV)/bin/mypy services/mars services/mars_* infra/mars_stack
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf services/mars/v1 .pytest_cache .mypy_cache .ruff_cache
