"""The import stubs that let torchtitan's model code load without its data and logging dependencies."""

from __future__ import annotations

import abc
import importlib
import sys

import pytest

from benchmarks.training.workloads import _StubFinder, stub_missing_modules

NAME = "plait_absent_dependency"  # a package that is not installed


@pytest.fixture
def stubbed():
    before = list(sys.meta_path)
    yield stub_missing_modules([NAME, "json"])
    sys.meta_path[:] = before
    for mod in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        del sys.modules[mod]


def test_missing_packages_and_their_submodules_are_stubbed(stubbed: list[str]) -> None:
    assert stubbed == [NAME]  # json imports: it stays the real module
    assert isinstance(sys.modules["json"].loads("1"), int)
    distributed = importlib.import_module(f"{NAME}.distributed")
    split = distributed.split_dataset_by_node
    assert isinstance(split, type)
    tyro = importlib.import_module(NAME)
    assert isinstance(tyro.constructors.ConstructorRegistry, type)  # attribute chains at import time

    @tyro.conf.configure(1)
    def f() -> int:
        return 2

    assert f() == 2  # a stub used as a decorator keeps the function


def test_stub_classes_mix_with_abstract_and_protocol_bases(stubbed: list[str]) -> None:
    from torch.distributed.checkpoint.stateful import Stateful

    mod = importlib.import_module(f"{NAME}.stateful_dataloader")

    class Base(Stateful, abc.ABC):
        pass

    class Loader(mod.StatefulDataLoader, Base):  # torchtitan's ParallelAwareDataloader
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    assert isinstance(Loader(), Base)


def test_the_finder_only_answers_for_its_roots() -> None:
    finder = _StubFinder([NAME])
    assert finder.find_spec("json") is None
    assert finder.find_spec(f"{NAME}x") is None
    assert finder.find_spec(f"{NAME}.a.b") is not None
