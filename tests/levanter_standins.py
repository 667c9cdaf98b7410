"""Import-time stand-ins that let marin-levanter's model modules import on Python 3.11.

Installed (with a .pth line) into the environment `tests/levanter_env.py` builds; never imported
by axkern. marin-levanter and marin-haliax declare Python >= 3.12, and on 3.11 three things stop
Levanter's model modules from importing; none is in the math the tests compare:

- packages Levanter imports for storage, checkpoints and logging (`STAND_IN_PACKAGES`): Marin's
  `rigging` (its telemetry is written in 3.12 syntax), `finestore` and `fray`, Hugging Face's
  `transformers`, `huggingface_hub` and `tokenizers` (config classes for checkpoint
  conversion), `wandb`, `git` and a few more. A name from them is a placeholder class: it can be imported, subclassed, called (a
  call with one function returns that function, as a decorator would) and its attributes
  read; it computes nothing. An installed package of the same name is used instead.
- two Levanter modules in 3.12 syntax (`STAND_IN_MODULES`, Hugging Face export and the
  pipeline), placeholders in the same way;
- `itertools.batched` (new in 3.12), added.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import sys
import types

STAND_IN_PACKAGES = {
    "finestore",
    "fray",
    "git",
    "huggingface_hub",
    "pytimeparse",
    "rigging",
    "tblib",
    "tokenizers",
    "tqdm_loggable",
    "transformers",
    "wandb",
}
STAND_IN_MODULES = {"levanter.compat.hf_export", "levanter.pipeline"}


class _PlaceholderType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}", cls.__module__)


def placeholder(qualname: str, module: str) -> type:
    """A class standing for `module.qualname`; its instances' attributes are placeholders too."""

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{qualname}.{name}", module)

    namespace = {"__module__": module, "__qualname__": qualname, "__new__": __new__, "__init__": __init__}
    namespace["__getattr__"] = __getattr__
    return _PlaceholderType(qualname.rpartition(".")[2], (), namespace)


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names, packages):
        self.names, self.packages = names, packages

    def find_spec(self, fullname, path, target=None):
        if fullname in self.names or fullname.partition(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _batched(iterable, n):
    it = iter(iterable)
    while chunk := tuple(itertools.islice(it, n)):
        yield chunk


if not hasattr(itertools, "batched"):
    itertools.batched = _batched  # type: ignore[attr-defined]
sys.meta_path.insert(0, _Finder(STAND_IN_MODULES, set()))  # before Levanter's own files
sys.meta_path.append(_Finder(set(), STAND_IN_PACKAGES))  # after installed packages
