"""flowgrpo: online RL (Flow-GRPO, MixGRPO, GRPO-Guard, DiffusionNFT) for flow-matching
text-to-image and text-to-video models."""

__version__ = "0.1.0"
