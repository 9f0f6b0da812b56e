"""Every exception class p2ptrain defines derives from its root, ``P2PTrainError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

import p2ptrain
from p2ptrain.errors import P2PTrainError


def _modules() -> list[types.ModuleType]:
    """p2ptrain's modules, less the test harnesses (p2ptrain.testing) and ``__main__`` (which runs
    the CLI on import)."""
    names = [
        info.name
        for info in pkgutil.walk_packages(p2ptrain.__path__, "p2ptrain.")
        if ".testing" not in info.name and not info.name.endswith("__main__")
    ]
    return [importlib.import_module(name) for name in names]


def _exceptions_outside_root(modules: list[types.ModuleType]) -> list[str]:
    """``module.Class`` of every exception class defined in ``modules`` that does not derive from
    ``P2PTrainError``."""
    return [
        f"{module.__name__}.{name}"
        for module in modules
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == module.__name__
        and not issubclass(obj, P2PTrainError)
    ]


def test_every_p2ptrain_exception_derives_from_the_root() -> None:
    modules = _modules()
    assert len(modules) > 50  # the walk reached the subpackages
    assert _exceptions_outside_root(modules) == []


def test_the_check_catches_an_exception_outside_the_root() -> None:
    class Stray(ValueError):
        pass

    class Rooted(P2PTrainError, ValueError):
        pass

    module = types.ModuleType("p2ptrain.fake")
    for cls in (Stray, Rooted):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    assert _exceptions_outside_root([module]) == ["p2ptrain.fake.Stray"]


def test_existing_bases_are_kept() -> None:
    from p2ptrain.checkpoint.errors import StateTimeoutError
    from p2ptrain.checkpoint.info import CheckpointNotFound
    from p2ptrain.optim.options import OptionError

    assert issubclass(OptionError, ValueError)
    assert issubclass(StateTimeoutError, TimeoutError)
    assert issubclass(CheckpointNotFound, KeyError)
    with pytest.raises(P2PTrainError):
        raise OptionError("bad option", "--bad: bad option")
    assert p2ptrain.P2PTrainError is P2PTrainError
