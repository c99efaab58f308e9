"""kvmesh's compiled parts, both optional: where they cannot be built (no C compiler) the install
goes on and the same code runs as Python.

- router/_bytelevel.pyx: the router's byte-level BPE scan, whose twin is router.fastbpe's Python
  path (tests/test_router_bytelevel.py holds them equal).
- COMPILED: modules of the router's request path that Cython compiles as they are written (no
  Cython types; annotations are not read as C types), so the source stays the one definition
  and is its own twin: kvmesh/_fresh.py loads a module's .py where it is newer than its build
  or when KVMESH_PURE_PYTHON=1 (tests/test_compiled_twins.py runs the path both ways).
"""

from setuptools import Extension, setup

COMPILED = [
    "kvmesh/protocol/hashing",
    "kvmesh/protocol/openai",
    "kvmesh/protocol/prompt",
    "kvmesh/router/approx_index",
    "kvmesh/router/block_keys",
    "kvmesh/router/forward",
    "kvmesh/router/forward_load",
    "kvmesh/router/frontdoor",
    "kvmesh/router/handlers",
    "kvmesh/router/index",
    "kvmesh/router/pipeline",
    "kvmesh/router/plugins/latency",
    "kvmesh/router/plugins/pickers",
    "kvmesh/router/plugins/placement",
    "kvmesh/router/plugins/prefix",
    "kvmesh/router/plugins/profile_handlers",
    "kvmesh/router/plugins/scorers",
    "kvmesh/router/plugins/state",
    "kvmesh/router/proxy",
    "kvmesh/router/request_parser",
    "kvmesh/router/request_reader",
    "kvmesh/router/text_runs",
    "kvmesh/router/tokens",
    "kvmesh/router/upstream_pool",
]


def extensions() -> list[Extension]:
    scan = Extension(
        "kvmesh.router._bytelevel", ["src/kvmesh/router/_bytelevel.pyx"], optional=True
    )
    try:
        from Cython.Build import cythonize
    except ImportError:  # (the build system asks for Cython; a bare `setup.py` run may not)
        return []
    modules = [
        Extension(path.replace("/", "."), [f"src/{path}.py"], optional=True) for path in COMPILED
    ]
    built = cythonize(
        [scan, *modules],
        compiler_directives={"language_level": 3, "binding": True, "annotation_typing": False},
        quiet=True,
    )
    for ext in built:
        ext.optional = True
    return built


setup(ext_modules=extensions(), options={"build_ext": {"parallel": 2}})
