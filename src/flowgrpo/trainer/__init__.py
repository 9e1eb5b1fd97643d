"""The trainer, a module per job: the training loop (``loop``), the commands that use a
checkpoint (``commands``: sample, eval, export), the built run with its rollouts and eval
(``run``), the run folder (``run_folder``: lock, outputs, checkpoint markers), the seeds
(``seeds``), the builders (``setup``), the logging and the figures.

Import the entry points from ``flowgrpo.trainer.loop`` (training) and
``flowgrpo.trainer.commands``; this package imports nothing heavy.
"""

__all__ = ["run_eval", "run_export_lora", "run_sample", "run_training"]


def __getattr__(name: str):
    if name in __all__:
        from flowgrpo.trainer import loop  # it imports the commands too

        return getattr(loop, name)
    raise AttributeError(name)
