"""eyas: train EAGLE-3 draft models for speculative decoding."""

__version__ = "0.1.0"
