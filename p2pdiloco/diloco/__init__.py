"""The DiLoCo training algorithm: fragments, outer optimizer, streaming overlap (the loop that drives
it: :mod:`p2pdiloco.train`)."""
