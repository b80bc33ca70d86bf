# The two commands a new user needs: `make serve` and `make test`.
VENV  ?= .venv
PY    := $(VENV)/bin/python
FAMILY ?= llava
MODEL ?= models/tiny-$(FAMILY)
HOST  ?= 127.0.0.1
PORT  ?= 8000

.PHONY: compose-keys docs setup serve test test-fast lint bench bench-throughput bench-families model bench-load bench-input-scale bench-ec bench-engine bench-attention bench-video bench-media-ids bench-structured bench-scoring bench-priority bench-schema-compile bench-sampling bench-agents bench-prefix-match bench-ray dashboard-image

# torch is installed first and pinned: an unpinned torch would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	# mooncake's wheel (the encoder-cache store) links libibverbs.so.1, even for TCP only
	ldconfig -p | grep -q libibverbs.so.1 || (apt-get update && apt-get install -y libibverbs1)
	# Debian's Prometheus (and promtool): tests/e2e/test_monitoring.py runs it on the monitoring profile's files
	command -v prometheus >/dev/null || (apt-get update && apt-get install -y prometheus)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	# xgrammar lists triton for its CUDA kernels only. Beside a CPU-only torch it is 1 GB unused that
	# transformers imports into every process when it is there (about 80 MB each): removed
	$(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && $(PY) -m pip uninstall -y -q triton || true
	# compose-spec JSON schema for validating docker-compose.yml without a Docker engine
	$(PY) -m pip install -q --no-deps docker-compose==1.29.2
	# test-only: torchvision in $(VENV)/hf-reference for transformers' video processors, which the tests run
	# in a subprocess as the reference for the product's own (torch-only) video processing
	$(PY) tests/reference/setup_env.py $(VENV)/hf-reference
	# test-only: the GPU image's Triton in $(VENV)/triton, to compile the kernels for the H100 without one
	$(PY) tests/triton/setup_env.py $(VENV)/triton
	touch $@

setup: $(VENV)/.installed

$(MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/mmserve build-tiny-model --family $(FAMILY) --out $(MODEL)

model: $(MODEL)/config.json

serve: setup model
	$(VENV)/bin/mmserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# two pytest-xdist workers: the tests on the session's shared servers in one, every other module beside
# them (tests/conftest.py)
test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The CURVE key pair docker-compose mounts as the secret mmserve_curve (made once; never committed)
compose-keys: setup
	test -f secrets/mmserve-curve.key || $(VENV)/bin/mmserve curve-keygen --out secrets/mmserve-curve.key

# ~3 min: docs/img/dashboard.png, the Grafana dashboard's panels drawn from a real Prometheus's answers
dashboard-image: setup
	$(PY) monitoring/draw_dashboard.py

# docs/configuration.md, generated from the settings and the CLI (tests/unit/test_config_doc.py checks it)
docs: setup
	$(PY) -m app.launch.config_doc > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

lint: setup
	$(VENV)/bin/ruff check app engine workers wire bench tests monitoring
	$(VENV)/bin/ruff format --check app engine workers wire bench tests monitoring
	$(VENV)/bin/mypy app engine workers wire

bench: setup model
	$(PY) bench/bench_api_cache.py --model $(MODEL)

# ~10 min: TTFT cold / encoder-cache warm / all warm, and req/s with 80 % image reuse, tiny Qwen2-VL and Qwen3-VL
bench-families: setup
	$(PY) bench/bench_families.py

# ~5 min: HEAD vs the pre-paged-KV revision (throughput by concurrency), worker RSS over 2,000 requests
bench-throughput: setup model
	$(PY) bench/bench_throughput.py --model $(MODEL)

# ~2 min: locust, 32 users for 60 s on loopback (text, repeated and unique images, 5 % hostile requests);
# every answer complete, every hostile request its 4xx, each process's RSS within its cache bounds
bench-load: setup model
	$(PY) bench/bench_load.py --model $(MODEL)

# ~10 min: the input path at scale: cold-miss req/s for 1-2 API processes x 1, 2, 4 preprocessing
# workers; 90 % image reuse, lru vs shm processor cache; bytes copied per miss on each path
bench-input-scale: setup model
	$(PY) bench/bench_input_scale.py --model $(MODEL)

# ~8 min: the encoder-cache connector on a tiny Qwen2.5-VL, 1024x768 JPEGs: TTFT cold / loaded from another
# instance's encode (shared-storage, mooncake) / warm; save and load per item on both stores (tiny and 7B-sized
# outputs); req/s over two replicas with 80 % image reuse, shared-storage vs no connector
bench-ec: setup
	$(PY) bench/bench_ec.py

# ~11 min: the engine-step loads on HEAD, 7786cb7 and vLLM's CPU peer (if set up), one server at a time
bench-engine: setup model
	$(PY) bench/bench_engine.py --model $(MODEL)

# ~5 min: video on a tiny Qwen2.5-VL: per-clip stage times, TTFT cold / encoder-cache warm / all warm,
# req/s at 80 % clip reuse with every cache on vs off; draws docs/img/video.png
bench-video: setup
	$(PY) bench/bench_video.py

# ~3 min: eight 1024x1024 JPEGs at 100 % reuse, sent every time vs named by uuid alone, beside text-only
# requests of the same prompt length: req/s, TTFT, API CPU per request; draws docs/img/media_ids.png
bench-media-ids: setup model
	$(PY) bench/bench_media_ids.py --model $(MODEL)

# ~5 min: 16 agents in a steady state, five-turn conversations with a new 1024x1024 screenshot a turn: full
# history resent vs previous_response_id vs no history (the control); draws docs/img/agents.png
bench-agents: setup model
	$(PY) bench/bench_agents.py --model $(MODEL)

# ~4 min: prefix-cache hits of whole blocks vs up to the first new token (--prefix-match block, token), one
# server each, bench-agents' chained steady load: encoder runs, turns/s, TTFT by turn; draws docs/img/prefix_match.png
bench-prefix-match: setup model
	$(PY) bench/bench_prefix_match.py --model $(MODEL)

# ~8 min: mmserve ray serve, two replicas, the media-affinity router vs Ray Serve's default and prefix-cache
# routers: 32 users x 6 turns, history resent, 80 % repeated 1024x1024 JPEGs, three pause lengths between
# turns, medians of 3 interleaved rounds; draws docs/img/ray_routers.png
bench-ray: setup model
	$(PY) bench/bench_ray.py --model $(MODEL)

# ~9 min: a 10-field JSON schema (compact, as response_format answers, and spaced) vs free text at c=16, 64 tokens, 90 % reuse of 1024x1024 JPEGs, on the tiny
# LLaVA and Qwen2.5-VL and vLLM's CPU peer (if set up); a schema's first use vs a repeat; draws docs/img/structured.png
bench-structured: setup
	$(PY) bench/bench_structured.py

# ~3 min: lm-eval's log-likelihood requests (echo + logprobs) vs plain completions at c=4, mmserve vs vLLM's CPU peer (if set up), logprob cross-check; draws docs/img/scoring.png
bench-scoring: setup
	$(PY) bench/bench_scoring.py

# ~5 min: an interactive request's TTFT behind a bulk load at the bulk's priority and a higher one
# (--scheduling-policy priority), mmserve vs vLLM's CPU peer (if set up); draws docs/img/priority.png
bench-priority: setup
	$(PY) bench/bench_priority.py

# ~1 min: one JSON schema's compile, mmserve's engine vs xgrammar's compile_json_schema (vLLM's, SGLang's),
# in one process: everyday patterns, formats, long bounded repetitions; draws docs/img/schema_compile.png
bench-schema-compile: setup model
	$(PY) bench/bench_schema_compile.py --model $(MODEL)

# ~6 min: n=4 vs four requests (at once, in turn) per new 1024x1024 JPEG (choices/s; processor and encoder runs, prefix hits per
# image), penalties vs none at c=16, 64 tokens, on the tiny LLaVA and Qwen2.5-VL; draws docs/img/sampling.png
bench-sampling: setup
	$(PY) bench/bench_sampling.py

# ~2 min: the worker's LM forward on one step per attention backend (glibc's malloc and the worker's),
# and the kernel candidates (SDPA with a mask, flex_attention)
bench-attention: setup model
	$(PY) bench/bench_attention.py --model $(MODEL)
