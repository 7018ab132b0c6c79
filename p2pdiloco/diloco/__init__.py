"""The DiLoCo training algorithm: fragments, outer optimizer, the training loop."""
