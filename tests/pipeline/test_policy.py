"""Layout policy: which transform and which codec each plane of an item gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nvdcp
from nvdcp.codecs import GPU_ONLY, codec_class
from nvdcp.format.dtypes import DTYPE_TO_CODE
from nvdcp.format.header import TRANSFORM_BYTEPLANES, TRANSFORM_NONE
from nvdcp.pipeline.policy import (
    CPU_AUTO_CODEC,
    GPU_AUTO_CODEC,
    Layout,
    choose_delta_layout,
    choose_layout,
    next_delta_plane_codecs,
    validate_codec_choice,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

NONE3 = ("none", "none", "none")


def test_auto_codecs_are_cpu_decodable() -> None:
    assert CPU_AUTO_CODEC == "zstd"
    assert GPU_AUTO_CODEC == "gdeflate"
    for name in (CPU_AUTO_CODEC, GPU_AUTO_CODEC):
        assert name not in GPU_ONLY
        assert codec_class(name).cpu_decodable


def test_gpu_only_codecs() -> None:
    assert {"ans", "bitcomp"} <= GPU_ONLY
    assert not {"none", "zstd", "gdeflate"} & GPU_ONLY


@pytest.mark.parametrize(
    ("dtype", "codec", "auto_codec", "expected"),
    [
        # float32: only the sign+exponent plane gets the codec
        (torch.float32, "auto", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, NONE3 + ("zstd",))),
        (torch.float32, "auto", GPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, NONE3 + ("gdeflate",))),
        (torch.float32, "zstd", GPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, NONE3 + ("zstd",))),
        (torch.float32, "gdeflate", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, NONE3 + ("gdeflate",))),
        (torch.float32, "none", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("none",))),
        (torch.float32, "ans", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("ans",))),
        (torch.float32, "bitcomp", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("bitcomp",))),
        # bfloat16: two planes, the high one compressed
        (torch.bfloat16, "auto", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("none", "zstd"))),
        (torch.bfloat16, "auto", GPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("none", "gdeflate"))),
        (torch.bfloat16, "gdeflate", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("none", "gdeflate"))),
        (torch.bfloat16, "none", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("none",))),
        (torch.bfloat16, "ans", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("ans",))),
        # int64: every plane compressed
        (torch.int64, "auto", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("zstd",) * 8)),
        (torch.int64, "auto", GPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("gdeflate",) * 8)),
        (torch.int64, "zstd", CPU_AUTO_CODEC, Layout(TRANSFORM_BYTEPLANES, ("zstd",) * 8)),
        (torch.int64, "none", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("none",))),
        (torch.int64, "bitcomp", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("bitcomp",))),
        # bool: one byte, no planes to split
        (torch.bool, "auto", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("zstd",))),
        (torch.bool, "auto", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("gdeflate",))),
        (torch.bool, "gdeflate", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("gdeflate",))),
        (torch.bool, "none", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("none",))),
        (torch.bool, "ans", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("ans",))),
        # bytes items (dtype None): never a GPU-only codec, never planes
        (None, "auto", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("zstd",))),
        (None, "auto", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("gdeflate",))),
        (None, "zstd", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("zstd",))),
        (None, "gdeflate", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("gdeflate",))),
        (None, "none", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, ("none",))),
        (None, "ans", CPU_AUTO_CODEC, Layout(TRANSFORM_NONE, (CPU_AUTO_CODEC,))),
        (None, "bitcomp", GPU_AUTO_CODEC, Layout(TRANSFORM_NONE, (CPU_AUTO_CODEC,))),
    ],
)
def test_choose_layout(dtype: torch.dtype | None, codec: str, auto_codec: str, expected: Layout) -> None:
    assert choose_layout(dtype, codec, auto_codec) == expected


def test_choose_layout_default_auto_is_the_cpu_codec() -> None:
    assert choose_layout(torch.float32, "auto") == choose_layout(torch.float32, "auto", CPU_AUTO_CODEC)
    assert choose_layout(None, "auto").plane_codecs == (CPU_AUTO_CODEC,)


@pytest.mark.parametrize("dtype", [None, *sorted(DTYPE_TO_CODE, key=str)])
@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none", "ans", "bitcomp"])
@pytest.mark.parametrize("auto_codec", [CPU_AUTO_CODEC, GPU_AUTO_CODEC])
def test_layout_invariants(dtype: torch.dtype | None, codec: str, auto_codec: str) -> None:
    layout = choose_layout(dtype, codec, auto_codec)
    size = 1 if dtype is None else torch.empty((), dtype=dtype).element_size()
    if layout.transform == TRANSFORM_BYTEPLANES:
        assert len(layout.plane_codecs) == size > 1
    else:
        assert layout.transform == TRANSFORM_NONE and len(layout.plane_codecs) == 1
    if any(name in GPU_ONLY for name in layout.plane_codecs):
        # GPU-only codecs are typed: they see whole elements, never planes, never bytes items
        assert dtype is not None
        assert layout.transform == TRANSFORM_NONE
        assert layout.plane_codecs == (codec,)
    if dtype is None:
        assert layout.plane_codecs[0] not in GPU_ONLY
    # only the chosen (or auto) codec and "none" ever appear
    chosen = auto_codec if codec == "auto" else codec
    allowed = {chosen, "none"} if dtype is not None or chosen not in GPU_ONLY else {CPU_AUTO_CODEC}
    assert set(layout.plane_codecs) <= allowed
    assert layout.descriptor_codec == next((c for c in layout.plane_codecs if c != "none"), "none")


def test_layout_is_cached_and_frozen() -> None:
    a = choose_layout(torch.float16, "zstd")
    assert choose_layout(torch.float16, "zstd") is a
    with pytest.raises(AttributeError):
        a.transform = TRANSFORM_NONE  # type: ignore[misc]
    assert hash(a) == hash(Layout(a.transform, a.plane_codecs))


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Layout(TRANSFORM_BYTEPLANES, ("none", "none", "none", "zstd")), "zstd"),
        (Layout(TRANSFORM_BYTEPLANES, ("none", "gdeflate")), "gdeflate"),
        (Layout(TRANSFORM_BYTEPLANES, ("zstd", "gdeflate")), "zstd"),
        (Layout(TRANSFORM_NONE, ("none",)), "none"),
        (Layout(TRANSFORM_NONE, ("ans",)), "ans"),
    ],
)
def test_layout_descriptor_codec(layout: Layout, expected: str) -> None:
    assert layout.descriptor_codec == expected


@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none", "ans", "bitcomp"])
def test_validate_codec_choice_returns_it(codec: str) -> None:
    assert validate_codec_choice(codec) == codec


@pytest.mark.parametrize("codec", ["lz4", "AUTO", "", "zstd ", None])
def test_validate_codec_choice_rejects(codec: object) -> None:
    with pytest.raises(nvdcp.UnknownCodecError, match="known codecs"):
        validate_codec_choice(codec)  # type: ignore[arg-type]


# -- delta layouts -------------------------------------------------------------------------------
def test_gpu_auto_delta_layout_gives_the_top_plane_zstd() -> None:
    assert choose_delta_layout(torch.float32, "auto", GPU_AUTO_CODEC) == Layout(
        TRANSFORM_BYTEPLANES, ("gdeflate", "gdeflate", "gdeflate", "zstd"))
    assert choose_delta_layout(torch.bfloat16, "auto", GPU_AUTO_CODEC) == Layout(TRANSFORM_BYTEPLANES, ("gdeflate", "zstd"))
    assert choose_delta_layout(torch.uint8, "auto", GPU_AUTO_CODEC) == Layout(TRANSFORM_NONE, ("zstd",))


def test_gpu_auto_delta_layout_follows_a_valid_hint_only() -> None:
    hint = ("zstd", "zstd")
    assert choose_delta_layout(torch.bfloat16, "auto", GPU_AUTO_CODEC, hint).plane_codecs == hint
    default = choose_delta_layout(torch.bfloat16, "auto", GPU_AUTO_CODEC)
    for bad in [("zstd",), ("zstd", "zstd", "zstd"), ("zstd", "ans"), ("lz4", "zstd")]:
        assert choose_delta_layout(torch.bfloat16, "auto", GPU_AUTO_CODEC, bad) == default, bad


@pytest.mark.parametrize("codec", ["zstd", "gdeflate", "ans"])
def test_delta_layout_of_a_named_codec_or_the_cpu_path_ignores_hints(codec: str) -> None:
    hint = ("zstd",) * 4
    expected = GPU_AUTO_CODEC if codec == "ans" else codec
    assert choose_delta_layout(torch.float32, codec, GPU_AUTO_CODEC, hint).plane_codecs == (expected,) * 4
    assert choose_delta_layout(torch.float32, "auto", CPU_AUTO_CODEC, ("gdeflate",) * 4).plane_codecs == ("zstd",) * 4
    assert choose_delta_layout(torch.float32, "none", GPU_AUTO_CODEC, hint) is None


def test_next_delta_plane_codecs_by_each_planes_ratio() -> None:
    # 2 blocks x 4 planes of a 64 KiB-per-plane item (raw 2 x 4 x 32 KiB = 256 KiB): per plane
    # stored 64 KiB (1x), 20 KiB (3.2x), 9,363 B (just over 7x), 9,364 B (just under 7x)
    per_plane = (32768, 10240, 4681, 4682)
    sizes = np.array(per_plane * 2, dtype=np.uint32)
    assert next_delta_plane_codecs(256 << 10, 4, sizes) == ("gdeflate", "gdeflate", "zstd", "gdeflate")
    assert next_delta_plane_codecs(256 << 10, 4, np.full(8, 10, dtype=np.uint32)) == ("zstd",) * 4
    assert next_delta_plane_codecs(100, 1, np.array([0], dtype=np.uint32)) == ("zstd",)  # stored in 0 bytes


@pytest.mark.parametrize("raw, planes, n_chunks", [(0, 4, 0), (100, 4, 3), (100, 0, 1), (100, 2, 0)])
def test_next_delta_plane_codecs_gives_nothing_for_what_it_cannot_read(raw: int, planes: int, n_chunks: int) -> None:
    assert next_delta_plane_codecs(raw, planes, np.ones(n_chunks, dtype=np.uint32)) == ()
