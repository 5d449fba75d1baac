"""The accelplane conformance suite: one pytest plugin that proves any backend plugin.

Run it with ``accelplane conformance NAME`` or ``pytest --accelplane-plugin NAME``.
"""
