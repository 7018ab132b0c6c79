"""On a GPU (marker ``gpu``, outside the default run: ``make test-gpu``; ``bench/device_run.sh`` runs it
first on a lent device): a CUDA peer holds bitwise the state of the CPU peers beside it.

* Through the real CLI, the runs of ``tests/test_exactness_hw.py`` (fp32 with tau, e3m0 with delay,
  low-rank with eager, sparse with tau, nf4 with eager's heuristic) with the first peer on
  ``train.device=cuda`` and the others on the CPU under different ATen kernel builds: every sync ok in
  a full group, the same digest on every peer after every (fragment, round) and at the start, no state
  downloaded to repair a divergence.
* Every codec encodes a CUDA tensor to exactly the bytes it encodes the same values to from the CPU.

Without a CUDA device the module fails rather than pass vacuously; ``P2PDILOCO_TEST_GPU_DEVICE=cpu``
runs it with the CPU in the GPU's place, to check the tests themselves on a machine without one.
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY
from p2pdiloco.compression import get_codec
from test_exactness_hw import BASE, CAPS, RUNS, assert_one_state_everywhere

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("P2PDILOCO_TEST_GPU_DEVICE", "cuda")


@pytest.fixture(autouse=True)
def _a_gpu():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("no CUDA device here: run these tests on a GPU machine "
                    "(or with P2PDILOCO_TEST_GPU_DEVICE=cpu to check the tests themselves)")


@pytest.mark.parametrize("codec", ["fp32", "fp16", "e3m0", "nf4", "fp4", "sparse"])
def test_a_codec_encodes_a_gpu_tensor_to_the_cpu_bytes(codec):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3 * 4096 + 17, generator=g) * torch.logspace(-3, 1, 3 * 4096 + 17)
    c = get_codec(codec)
    assert c.encode(x.to(DEVICE)) == c.encode(x)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", list(RUNS))
def test_a_gpu_peer_beside_cpu_peers_stays_bitwise_identical(procs, tmp_path, run):
    settings, wanted = RUNS[run]
    caps = [c if c in CAPS else CAPS[i % len(CAPS)] for i, c in enumerate(wanted)]
    devices = [DEVICE] + ["cpu"] * (len(caps) - 1)
    n = len(caps)
    addr = procs.bootstrap()
    peers = [procs.start("join", "--initial-peers", addr, "--config", TINY, *sum(
        (["--set", s] for s in BASE + settings + [f"swarm.run_id=gpu-{run}", f"swarm.min_peers_to_start={n}",
                                                  f"train.device={dev}", f"data.shard={i}",
                                                  f"train.run_dir={tmp_path}/p{i}"]), []),
        name=f"p{i}", env={"ATEN_CPU_CAPABILITY": cap}) for i, (cap, dev) in enumerate(zip(caps, devices))]
    for p in peers:
        assert procs.wait(p, 300) == 0, procs.err(p.name)[-3000:]

    assert_one_state_everywhere(tmp_path, run, n, lambda i, start: (  # each really trained where told
        start["device"].split(":")[0] == devices[i], (devices[i], start["device"])))
