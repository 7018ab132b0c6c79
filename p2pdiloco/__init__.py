"""p2pdiloco: peer-to-peer, low-communication (DiLoCo) training of language models by volunteers."""
__version__ = "0.1.0"
