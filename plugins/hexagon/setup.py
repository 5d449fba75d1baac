"""Build hook for the emulated NPU's cffi kernels (API mode, compiled at install time)."""

from setuptools import setup

setup(cffi_modules=["accelplane_hexagon/_build.py:ffibuilder"])
