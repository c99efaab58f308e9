"""The one compiled part of kvmesh: router/_bytelevel.pyx (Cython), the router's byte-level BPE
scan. It is optional: where it cannot be built (no C compiler) the install goes on and the
router uses its pure-Python twin, router.fastbpe, which the tests hold it equal to."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvmesh.router._bytelevel",
            ["src/kvmesh/router/_bytelevel.pyx"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
