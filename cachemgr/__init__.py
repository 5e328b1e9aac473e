"""cachemgr: keep TorchInductor compile caches indexed, bounded and warm."""

__version__ = "0.1.0"
