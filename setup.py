"""Build hook for nvdcp's one optional native piece; all package metadata is in pyproject.toml.

``nvdcp.codecs._gdeflate_guard`` keeps a malformed GDeflate stream from aborting the process
(docs/SECURITY.md). It is optional: without a C++ compiler the build warns, skips it, and nvdcp
calls nvCOMP's CPU decoder directly.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nvdcp.codecs._gdeflate_guard",
            sources=["nvdcp/codecs/_gdeflate_guard.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-fexceptions"],
            optional=True,
        )
    ]
)
