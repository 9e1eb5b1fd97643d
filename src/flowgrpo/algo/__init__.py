"""The old name of :mod:`flowgrpo.functional` (the tensor math the algorithms share), kept so
that earlier imports keep working: ``flowgrpo.algo`` and ``flowgrpo.algo.<module>`` are the
same module objects as their ``flowgrpo.functional`` names (no second copy of any class)."""

import importlib
import pkgutil
import sys

import flowgrpo.functional as _functional
from flowgrpo.functional import *  # noqa: F403 -- the re-export is this module's job
from flowgrpo.functional import __all__  # noqa: F401

for _info in pkgutil.iter_modules(_functional.__path__):
    _module = importlib.import_module(f"{_functional.__name__}.{_info.name}")
    sys.modules[f"{__name__}.{_info.name}"] = _module
    globals()[_info.name] = _module
