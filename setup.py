"""Builds the optional C kernels of the int8 codec; everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler, an unusual platform) the
install still succeeds with a warning, and the codec runs its torch path, bit-identical on the wire
and about 1.7x slower per int8 round on loopback (README, "Averaging")."""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: a fused multiply-add inside the round-to-nearest trick would change which
# integer a value rounds to, and the encode must match the torch path bit for bit.
# -pthread: big calls run in parts on a few POSIX threads (not on Windows: there they run as one call).
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "p2ptrain.compression._int8_kernels",
            ["p2ptrain/compression/_int8_kernels.c"],
            extra_compile_args=FLAGS,
            extra_link_args=FLAGS[-1:],
            optional=True,
        )
    ]
)
