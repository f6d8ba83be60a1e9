"""Build hook for nvdcp's optional native pieces; all package metadata is in pyproject.toml.

``nvdcp.codecs._gdeflate_guard`` keeps a malformed GDeflate stream from aborting the process
(docs/SECURITY.md); ``nvdcp.codecs._zstd_batch`` compresses many float planes' chunks in one
call (nvdcp/codecs/zstd_literals.py); ``nvdcp.format._crc32c_batch`` checksums many chunks in one call, on several
threads (nvdcp/format/crc.py), and splits and merges byte planes (nvdcp/pipeline/cpu.py). All
are optional: without a C++ compiler the build warns, skips them, and nvdcp calls nvCOMP's CPU
decoder directly, compresses chunks one call at a time, checksums with the crc32c package and
moves byte planes with numpy.
"""

from setuptools import Extension, setup


def _threaded(name: str, optimize: str) -> Extension:
    """An optional C++17 extension that starts its own threads; ``name``'s source is ``name``'s path + .cpp."""
    return Extension(
        name,
        sources=[name.replace(".", "/") + ".cpp"],
        language="c++",
        extra_compile_args=[optimize, "-std=c++17", "-pthread"],
        extra_link_args=["-pthread"],
        optional=True,
    )


setup(
    ext_modules=[
        Extension(
            "nvdcp.codecs._gdeflate_guard",
            sources=["nvdcp/codecs/_gdeflate_guard.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-fexceptions"],
            optional=True,
        ),
        _threaded("nvdcp.codecs._zstd_batch", "-O2"),
        _threaded("nvdcp.format._crc32c_batch", "-O3"),
    ]
)
