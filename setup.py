"""Build hook for the CPU plugin's cffi kernels (API mode, compiled at install time)."""

from setuptools import setup

setup(cffi_modules=["sdk/accelplane/cpu/_build.py:ffibuilder"])
