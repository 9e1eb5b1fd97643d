"""Prompt datasets, the K-repeat sampler and prompt-embedding padding utilities."""
