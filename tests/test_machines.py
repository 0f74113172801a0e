"""Node presets (estimate/machines.py) against the vendors' figures, and which link a ring crosses."""
import pytest

from labsupport.estimate import machines
from labsupport.estimate.flops import PEAK_TFLOPS
from labsupport.estimate.machines import MACHINES, Machine, link


def test_frontier_is_the_olcf_user_guide():
    """8 GCDs of 64 GB; one Infinity Fabric link of 50 GB/s per direction between GCDs; 4 NICs of
    25 GB/s per direction (the decks' "25+25 GB/s") for 8 GCDs: 12.5 GB/s each when all send, the
    pessimistic bound for a ring that crosses nodes (one NIC alone gives a boundary hop 25)."""
    m = MACHINES["Frontier (MI250X GCD)"]
    assert (m.devices_per_node, m.memory_gb) == (8, 64)
    assert m.intra_gbps == 50
    assert m.inter_gbps == 12.5 == 4 * 25 / m.devices_per_node
    assert "pessimistic bound" in machines.__doc__ and "upper bounds" in machines.__doc__
    assert m.peak_tflops_bf16 == PEAK_TFLOPS["MI250X"][1] == 191.5  # half of a module's 383


@pytest.mark.parametrize("name, nvlink_total, nic_gbit, gpu, peak", [
    ("DGX H100", 900, 400, "H100", 989.0),
    ("DGX A100", 600, 200, "A100", 312.0),
])
def test_dgx_is_the_nvidia_user_guide(name, nvlink_total, nic_gbit, gpu, peak):
    """NVLink's datasheet figure counts both directions; one ConnectX NIC per GPU, Gb/s / 8 = GB/s."""
    m = MACHINES[name]
    assert (m.devices_per_node, m.memory_gb) == (8, 80)
    assert m.intra_gbps == nvlink_total / 2
    assert m.inter_gbps == nic_gbit / 8
    assert m.peak_tflops_bf16 == PEAK_TFLOPS[gpu][1] == peak


def test_alphas_are_the_stated_orders_of_magnitude():
    for m in MACHINES.values():
        assert (m.intra_alpha_s, m.inter_alpha_s) == (5e-6, 10e-6), m.name


@pytest.mark.parametrize("name", list(MACHINES))
def test_a_group_that_fits_in_a_node_stays_on_its_links(name):
    m = MACHINES[name]
    inside = (m.intra_alpha_s, m.intra_gbps)
    across = (m.inter_alpha_s, m.inter_gbps)
    assert [link(m, t) for t in (1, 2, 4, 8)] == [inside] * 4
    assert [link(m, t) for t in (9, 16, 32)] == [across] * 3
    assert link(name, 16) == across  # by name, as the widget passes it
    assert across[1] < inside[1] and across[0] > inside[0]  # the network is slower in both respects


def test_machines_are_frozen_and_bad_input_is_refused():
    m = MACHINES["DGX H100"]
    assert isinstance(m, Machine)
    with pytest.raises(AttributeError):
        m.inter_gbps = 100
    with pytest.raises(ValueError, match="unknown machine"):
        link("Summit", 4)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="whole number"):
            link(m, bad)
