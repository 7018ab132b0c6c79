"""The training loop: a peer's life from joining the swarm to its summary (:mod:`.loop`), and the
inner step every trainer in the package shares (:mod:`.inner`).

Layer: above :mod:`p2pdiloco.diloco` (the algorithm) and :mod:`p2pdiloco.swarm` (the network), below
the local workers (:mod:`p2pdiloco.local.worker`), the CLI and the benchmarks.
"""
