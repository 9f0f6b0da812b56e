"""p2ptrain: peer-to-peer decentralized training for PyTorch, built on the dht package."""

__version__ = "0.1.0"
