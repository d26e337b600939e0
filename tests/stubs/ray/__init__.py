"""Test-only stand-in for ``ray``: verl imports it when its package is imported, the tests run nothing on Ray.

Every attribute and every ``ray.*`` submodule resolves to an inert placeholder; ``ray.remote`` returns what it
decorates. Put ``tests/stubs`` on ``PYTHONPATH`` (only when the real ray is not installed).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Inert:
    """Callable, subscriptable, attribute-rich placeholder; usable as a base class and a decorator."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Inert()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __getitem__(self, item):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)


def remote(*args, **kwargs):
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda obj: obj


def is_initialized():
    return False


class ObjectRef:
    pass


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (), {"__init__": lambda self, *a, **k: None})
        return _Inert()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []  # noqa: F811 - a package, so ray.* submodules resolve through the finder above


def __getattr__(name):
    if name[:1].isupper():
        return type(name, (), {"__init__": lambda self, *a, **k: None})
    return _Inert()
