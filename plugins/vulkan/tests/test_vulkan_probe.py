"""The probe's ctypes declarations of the Vulkan structs it reads when listing devices, and
its sType and flag values, against the ``vulkan`` package's (cffi over the Vulkan headers):
every struct's size and every member's offset. A wrong declaration would read garbage limits or
features without an error. Needs only the ``vulkan`` package (its cffi definitions), no device."""

from __future__ import annotations

import ctypes

import pytest

vk = pytest.importorskip("vulkan", reason="the vulkan package (the reference declarations) is not installed")
probe = pytest.importorskip("accelplane_vulkan.probe")

ST_NAMES = {
    "VkApplicationInfo": "VK_STRUCTURE_TYPE_APPLICATION_INFO",
    "VkInstanceCreateInfo": "VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO",
    "VkPhysicalDeviceProperties2": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2",
    "VkPhysicalDeviceFeatures2": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2",
    "VkPhysicalDeviceVulkan11Properties": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES",
    "VkPhysicalDeviceDriverProperties": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES",
    "VkPhysicalDeviceMaintenance4Properties": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES",
    "VkPhysicalDeviceVulkan11Features": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES",
    "VkPhysicalDeviceVulkan12Features": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES",
    "VkPhysicalDeviceVulkan13Features": "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES",
}


@pytest.mark.parametrize("name", sorted(probe.S))
def test_struct_layout_is_the_headers(name):
    ours = probe.S[name]
    assert ctypes.sizeof(ours) == vk.ffi.sizeof(name), name
    theirs = vk.ffi.typeof(name).fields  # every member of the header's struct, in its order
    assert [f for f, _ in ours._fields_] == [f for f, _ in theirs], name
    for (f, t), (_, field) in zip(ours._fields_, theirs, strict=True):
        assert getattr(ours, f).offset == field.offset, (name, f)
        assert ctypes.sizeof(t) == vk.ffi.sizeof(field.type), (name, f)


def test_stype_and_flag_values_are_the_headers():
    assert set(probe.ST) == set(ST_NAMES)
    assert {k: probe.ST[k] for k in ST_NAMES} == {k: getattr(vk, v) for k, v in ST_NAMES.items()}
    assert (probe.VK_SUCCESS, probe.VK_INCOMPLETE, probe.VK_ERROR_INCOMPATIBLE_DRIVER) == (
        vk.VK_SUCCESS, vk.VK_INCOMPLETE, vk.VK_ERROR_INCOMPATIBLE_DRIVER)
    ours = (probe.HEAP_DEVICE_LOCAL, probe.STAGE_COMPUTE, probe.SUBGROUP_ARITHMETIC)
    assert ours == (vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT, vk.VK_SHADER_STAGE_COMPUTE_BIT,
                    vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT)
