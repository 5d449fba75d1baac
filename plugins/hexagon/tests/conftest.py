"""Fixtures of the Hexagon plugin's tests: the first emulated HTP device, its buffer types and
a backend, plus helpers that build, place and run small graphs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("accelplane_hexagon", reason="accelplane-hexagon is not installed")

import accelplane  # noqa: E402
from accelplane.runtime.alloc import alloc_tensors  # noqa: E402


@pytest.fixture(scope="session")
def htp():
    return accelplane.device("HTP0")


@pytest.fixture(scope="session")
def repack(htp):
    (buft,) = htp.extra_buffer_types
    return buft


@pytest.fixture
def backend(htp):
    b = htp.new_backend()
    yield b
    b.free()


@pytest.fixture
def rng(request):
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


class Placed:
    """Tensors placed in buffers, freed together."""

    def __init__(self) -> None:
        self.buffers = []

    def put(self, buft, *tensors):
        b = alloc_tensors(tensors, buft)
        if b is not None:
            self.buffers.append(b)
        return b

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers = []


@pytest.fixture
def placed():
    p = Placed()
    yield p
    p.free()
