"""Build hook for the CPU plugin's cffi kernels (API mode, compiled at install time)."""

import sysconfig

from setuptools import setup

# cffi builds the module against the stable ABI (Py_LIMITED_API) except on a free-threaded
# CPython, so the wheel says abi3: one wheel for every CPython >= 3.11
ABI3 = {} if sysconfig.get_config_var("Py_GIL_DISABLED") else {"bdist_wheel": {"py_limited_api": "cp311"}}

setup(cffi_modules=["sdk/accelplane/cpu/_build.py:ffibuilder"], options=ABI3)
