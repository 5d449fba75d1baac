"""The built-in CPU plugin (entry point ``cpu = accelplane.cpu.plugin``)."""
