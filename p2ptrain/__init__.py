"""p2ptrain: peer-to-peer decentralized training for PyTorch, built on the dht package.

``p2ptrain.DHT`` (a DHT node on a background loop) and ``p2ptrain.DecentralizedOptimizer`` are
what a training script needs; both are imported lazily so that ``import p2ptrain`` stays light
(the CLI and the DHT tools do not load torch). ``p2ptrain.P2PTrainError`` is the root of every
exception p2ptrain defines.
"""

from typing import Any

from .errors import P2PTrainError

__version__ = "0.1.0"
__all__ = ["DHT", "DecentralizedOptimizer", "P2PTrainError", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "DHT":
        from .background import DHT

        return DHT
    if name == "DecentralizedOptimizer":
        from .optim import DecentralizedOptimizer

        return DecentralizedOptimizer
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
