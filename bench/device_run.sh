#!/usr/bin/env bash
# The GPU benchmark on a lent device machine, in one command (docs/benchmark.md, "On a GPU"):
# installs the carried wheels of .whl/ (bench/fetch_device_wheels.sh fills it) into /tmp/site ahead of
# the image's packages (numpy < 2.4 for hivemind shadows the image's 2.5), checks the imports and
# hivemind's p2p daemon, then runs python -m p2pdiloco.bench.gpu with its results under $OUT/gpu and
# this script's log as $OUT/device_run.log and the peers' logs as $OUT/work-logs.tgz. Extra arguments go to the benchmark (e.g. --parts ...).
# With --tests first, it runs the CUDA tests (pytest -m gpu tests/test_gpu.py; further arguments to pytest) instead,
# within P2PDILOCO_TESTS_TIMEOUT seconds (480). With --quality first, it runs bench.compression_quality on the GPU
# (its arguments follow; --jobs runs settings side by side, --time-limit stops them in time), results under
# $OUT/quality. Both in one call (the machine stays warm 30 s only):
#   bash bench/device_run.sh --parts prep,throughput,exactness && OUT=$OUT/tests bash bench/device_run.sh --tests
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/device}
mkdir -p "$OUT"
{
  # the device's copy of the tree may carry a stale .git: the package's content hash names what ran
  # (the same command here gives the same hash for the same tree)
  tree=$(find p2pdiloco -name '*.py' -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-12)
  echo "== $(date -u +%FT%TZ) commit ${P2PDILOCO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} p2pdiloco sha256 $tree $(uname -r) $(nproc) cores"
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run bench/fetch_device_wheels.sh and carry .whl"; exit 3; }
  if [ ! -e /tmp/site/.p2pdiloco-installed ]; then  # once per machine: a second call on it reuses the install
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.p2pdiloco-installed || { echo "wheel install failed"; exit 3; }
  fi
  export PYTHONPATH=/tmp/site:$PWD
  python3 - <<'PY' || exit 4
import os, subprocess, sys
import numpy, torch, transformers, tokenizers, hivemind, multiaddr, msgpack
print("python", sys.version.split()[0], "numpy", numpy.__version__, "from", os.path.dirname(numpy.__file__))
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "hivemind", hivemind.__version__)
assert tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 4), "numpy >= 2.4 breaks hivemind's codecs"
p2pd = os.path.join(os.path.dirname(hivemind.__file__), "hivemind_cli", "p2pd")
r = subprocess.run([p2pd, "-h"], capture_output=True, text=True, timeout=30)
print("p2pd runs:", p2pd, "exit", r.returncode, (r.stdout + r.stderr).strip().splitlines()[:1])
import p2pdiloco.swarm.node, p2pdiloco.hf  # noqa: F401  the swarm and HF paths import
PY
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  for t in ip tc; do  # the carried iproute2 (bench/fetch_device_wheels.sh) only where the image has none
    command -v $t >/dev/null || { [ -x .whl/iproute2/bin/$t ] && export PATH=$PATH:$PWD/.whl/iproute2/bin; break; }
  done
  echo "ip: $(command -v ip || echo missing) ($(ip -V 2>&1 | head -1)), tc: $(command -v tc || echo missing)"
  if [ "${1:-}" = "--quality" ]; then  # bench.compression_quality on the GPU instead (its arguments follow)
    shift
    mkdir -p "$OUT/quality"
    PYTHONUNBUFFERED=1 timeout 560 python3 -m p2pdiloco.bench.compression_quality --work /tmp/quality-work \
      --json "$OUT/quality/quality.json" --plot "$OUT/quality/quality.png" "$@"
    echo "== exit $? at $(date -u +%FT%TZ)"
    (cd /tmp/quality-work 2>/dev/null && tar czf "$OUT/quality/logs.tgz" .) && ls -la "$OUT/quality"
    exit 0
  fi
  if [ "${1:-}" = "--tests" ]; then  # the CUDA tests (tests/test_gpu.py) instead of the benchmark
    shift
    PYTHONUNBUFFERED=1 timeout "${P2PDILOCO_TESTS_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py --durations=0 "$@"
    echo "== pytest exit $? at $(date -u +%FT%TZ)"
    exit 0
  fi
  PYTHONUNBUFFERED=1 timeout 490 python3 -m p2pdiloco.bench.gpu --out "$OUT/gpu" --work /tmp/gpu-work "$@"
  echo "== exit $? at $(date -u +%FT%TZ)"
  # the peers' logs and metrics (not the token cache): what explains a part that went wrong
  (cd /tmp/gpu-work 2>/dev/null && find . -name '*.err' -o -name '*.out' -o -name '*.log' -o -name metrics.jsonl \
     | tar czf "$OUT/work-logs.tgz" -T -) && ls -la "$OUT/work-logs.tgz"
} 2>&1 | tee "$OUT/device_run.log"
