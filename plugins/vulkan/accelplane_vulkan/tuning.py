"""Every knob of the Vulkan plugin, in one frozen dataclass read through accelplane.env.

``read()`` parses the environment now (ConfigError for a bad value); the plugin takes a
snapshot where a setting is used (a device list when devices open, a plan when it is built, a
communicator when it is made). plugins/vulkan/README.md lists each variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelplane import env

OWNER = "vulkan"
MMV_ROWS = (0, 1, 2, 4, 8)
MMV_WG = (32, 64, 128, 256)
DEFAULT_CHUNK = 4 << 20


def _ints(name: str, default: int, allowed: tuple[int, ...], help: str) -> env.Var:
    def parse(s: str) -> int:
        if not s.isdigit() or int(s) not in allowed:
            raise ValueError(f"expected one of {', '.join(map(str, allowed))}")
        return int(s)

    return env.custom(name, default, help, "|".join(map(str, allowed)), parse, OWNER)


DEVICES = env.indices(
    "ACCELPLANE_VK_DEVICES",
    "physical device indices to open (a repeated index opens one device as several logical devices)", OWNER,
)
LOADER = env.text(
    "ACCELPLANE_VK_LOADER", None, "path of libvulkan.so.1 when it is not on the library path",
    "a file path", OWNER,
)  # fmt: skip


@dataclass(frozen=True)
class Tuning:
    """The plugin's settings (defaults: the measured best on the devices it was tuned on)."""

    devices: tuple[int, ...] | None = env.field(DEVICES)
    timeout_s: float = env.field(env.number(
        "ACCELPLANE_VK_TIMEOUT_S", 600.0, "host waits give up with ComputeError after this many seconds",
        min=0.001, owner=OWNER))  # fmt: skip
    shader_dir: str | None = env.field(env.text(
        "ACCELPLANE_VK_SHADER_DIR", None, "read the shaders from this directory (kernel development)",
        "a directory", OWNER))  # fmt: skip
    glslc: str = env.field(env.text(
        "ACCELPLANE_GLSLC", "glslc", "the glslc to run", "a command or path", OWNER))  # fmt: skip
    mmv_rows: int = env.field(_ints(
        "ACCELPLANE_VK_MMV_ROWS", 4, MMV_ROWS,
        "weight rows per workgroup of the quantized mat-vec (0: one row a workgroup, mul_mat_vec)"))
    mmv_wg: int = env.field(_ints(
        "ACCELPLANE_VK_MMV_WG", 128, MMV_WG, "threads per workgroup of the quantized mat-vec"))
    mmv_q8: bool = env.field(env.flag(
        "ACCELPLANE_VK_MMV_Q8", True,
        "quantized mat-vecs take int8 activations and packed 4x8-bit dot products where the device has "
        "them", OWNER))  # fmt: skip
    mmv_subgroup: bool = env.field(env.flag(
        "ACCELPLANE_VK_MMV_SUBGROUP", True,
        "mat-vec reductions with subgroupAdd (0: in shared memory)", OWNER))  # fmt: skip
    comm_off: bool = env.field(env.flag(
        "ACCELPLANE_VK_COMM_OFF", False, "no plugin communicator: the SDK's butterfly all-reduce",
        OWNER))  # fmt: skip
    comm_fp32: bool = env.field(env.flag(
        "ACCELPLANE_VK_COMM_FP32", False,
        "all-reduces keep F32 on the wire (default: F16 from ACCELPLANE_COMM_COMPRESS_MIN bytes)",
        OWNER))  # fmt: skip
    comm_chunk: int = env.field(env.integer(
        "ACCELPLANE_VK_COMM_CHUNK", DEFAULT_CHUNK, "bytes per chunk of the host-staged all-reduce",
        min=4096, owner=OWNER))  # fmt: skip
    transfer_queue: bool = env.field(env.flag(
        "ACCELPLANE_VK_TRANSFER_QUEUE", True,
        "copies on a transfer-only queue family where the device has one (its copy engines, beside the "
        "compute queues)", OWNER))  # fmt: skip
    delay_us: float | None = env.field(env.TEST_DELAY_US)


def read() -> Tuning:
    """The settings as the environment gives them now."""
    return env.read(Tuning)
