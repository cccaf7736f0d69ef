"""First-fit byte-range allocator of the arena, with exact expected offsets."""
import pytest

from services.adapter_store.byte_ranges import ByteRanges


def test_first_fit_in_address_order_with_alignment():
    r = ByteRanges(4096, align=256)
    assert [r.allocate(n) for n in (100, 256, 257, 1)] == [0, 256, 512, 1024]
    assert r.free_bytes == 4096 - 1280
    assert r.allocate(4096) is None


def test_freed_neighbours_coalesce_and_the_first_hole_that_fits_is_used():
    r = ByteRanges(2048, align=256)
    a, b, c, d = (r.allocate(256) for _ in range(4))
    r.free(b, 256)
    r.free(d, 256)  # d touches the tail: merges with it
    assert r.free_ranges() == [(256, 256), (768, 1280)]
    assert r.allocate(512) == 768  # the hole at 256 is too small
    r.free(c, 256)  # joins the hole at 256 into [256, 768)
    assert r.free_ranges() == [(256, 512), (1280, 768)]
    assert r.allocate(512) == 256
    assert r.largest_free == 768


def test_double_free_is_refused():
    r = ByteRanges(1024, align=256)
    off = r.allocate(256)
    r.free(off, 256)
    with pytest.raises(ValueError, match="double free"):
        r.free(off, 256)
