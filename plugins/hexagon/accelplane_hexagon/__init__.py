"""accelplane's Hexagon (HTP) plugin: ggml's Hexagon NPU backend, emulated in host C.

Registered through the ``accelplane.plugins`` entry point (``hexagon =
"accelplane_hexagon.plugin"``). See plugins/hexagon/README.md.
"""

__version__ = "0.1.0"
