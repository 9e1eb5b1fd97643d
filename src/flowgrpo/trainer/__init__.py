"""The training loop (``loop``), what it builds (``setup``), its logging and figures.

Import the entry points from ``flowgrpo.trainer.loop``; this package imports nothing heavy.
"""

__all__ = ["run_eval", "run_export_lora", "run_sample", "run_training"]


def __getattr__(name: str):
    if name in __all__:
        from flowgrpo.trainer import loop

        return getattr(loop, name)
    raise AttributeError(name)
