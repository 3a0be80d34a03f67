"""Client packages (the optional ``clients`` extra) imported over lazytensor.keops.install().

GPyTorch and GeomLoss decide at import time whether pykeops is there, so the
fixture imports them fresh with the mapping in place and forgets them
afterwards: the rest of the suite keeps the real pykeops (harness comparisons).
"""
import importlib
import importlib.util
import sys

import pytest

import lazytensor.keops as lk

CLIENTS = ("gpytorch", "geomloss")


def _forget(names) -> None:
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]


def _import_over_lazytensor(name: str):
    if importlib.util.find_spec(name) is None:  # not importorskip: importing it now would bind the real pykeops
        pytest.skip(f"{name} is not installed (the optional 'clients' extra)")
    _forget(CLIENTS)
    lk.install()
    return importlib.import_module(name)


def _client(name: str):
    @pytest.fixture(scope="module", name=name)
    def fixture():
        yield _import_over_lazytensor(name)
        lk.uninstall()
        _forget(CLIENTS)

    return fixture


gpytorch = _client("gpytorch")
geomloss = _client("geomloss")
