"""faulty_import: a plugin whose import fails (a dependency it imports at module level is
missing): broken, not a plugin without a device."""

import accelplane_fake_vendor_bindings  # noqa: F401  (never installed)
