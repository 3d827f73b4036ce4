import pytest

from pdpool.engine.connector.regions import (
    RegionError,
    RegionLayout,
    check_read_pair,
    layout_of_tensors,
)


def region(name="kv", units=4, slices=(100, 10), bases=(1000, 5000)):
    return RegionLayout(name, units, slices, bases)


def test_descriptors_are_tensor_major():
    r = region()
    assert r.unit_bytes == 110
    assert r.num_descriptors == 8
    assert r.descriptors() == [
        (1000, 100, 0),
        (1100, 100, 0),
        (1200, 100, 0),
        (1300, 100, 0),
        (5000, 10, 0),
        (5010, 10, 0),
        (5020, 10, 0),
        (5030, 10, 0),
    ]
    assert r.descriptor_indices([2, 0], offset=3) == [5, 3, 9, 7]


def test_read_pair_validation():
    local, remote = region(units=4), region(units=8)
    assert check_read_pair(local, remote, [0, 3], [7, 7]) == ([0, 3], [7, 7])
    with pytest.raises(RegionError, match=r"local region 'kv': ids \[4\] out of range \[0, 4\)"):
        check_read_pair(local, remote, [4], [0])
    with pytest.raises(RegionError, match=r"remote region 'kv': ids \[8\]"):
        check_read_pair(local, remote, [0], [8])
    with pytest.raises(RegionError, match="1 local ids for 2 remote ids"):
        check_read_pair(local, remote, [0], [0, 1])
    with pytest.raises(RegionError, match="unit layout differs"):
        check_read_pair(local, region(slices=(100, 11)), [0], [0])
    with pytest.raises(RegionError, match="not an integer"):
        check_read_pair(local, remote, [True], [0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"units": 0}, "num_units"),
        ({"slices": (100,)}, "one slice size per tensor"),
        ({"slices": (0, 10)}, "empty units"),
        ({"name": ""}, "needs a name"),
    ],
)
def test_invalid_layouts(kwargs, match):
    with pytest.raises(RegionError, match=match):
        region(**kwargs)


def test_layout_of_torch_tensors():
    torch = pytest.importorskip("torch")
    kv = torch.zeros((6, 2, 16, 8), dtype=torch.bfloat16)
    state = torch.zeros((6, 3), dtype=torch.float32)
    r = layout_of_tensors("kv", [kv, state])
    assert r.num_units == 6 and r.mem_type == "DRAM" and r.device_id == 0
    assert r.slice_bytes == (2 * 16 * 8 * 2, 12)
    assert r.base_addrs == (kv.data_ptr(), state.data_ptr())
    with pytest.raises(RegionError, match="contiguous"):
        layout_of_tensors("kv", [kv.transpose(1, 2)])
    with pytest.raises(RegionError, match="leading dimension 6"):
        layout_of_tensors("kv", [kv, torch.zeros(5, 3)])
    with pytest.raises(RegionError, match="no tensors"):
        layout_of_tensors("kv", [])
