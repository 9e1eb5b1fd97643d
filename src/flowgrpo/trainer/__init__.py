"""The Flow-GRPO training loop (``flow_grpo``) and its logging (``logging``).

Import the entry points from ``flowgrpo.trainer.flow_grpo``; this package imports nothing heavy.
"""

__all__ = ["run_eval", "run_export_lora", "run_sample", "run_training"]


def __getattr__(name: str):
    if name in __all__:
        from flowgrpo.trainer import flow_grpo

        return getattr(flow_grpo, name)
    raise AttributeError(name)
