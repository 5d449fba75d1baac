"""accelplane's Vulkan backend plugin (entry point ``vulkan = accelplane_vulkan.plugin``)."""

__version__ = "0.1.0"
