"""DFlow: lossless block-diffusion speculative decoding (DFlash) with verifier-state relay (DFlow)."""

__version__ = "0.1.0"
