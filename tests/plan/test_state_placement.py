"""Which units' state goes on NVMe (``plan.state_placement.place_state``)."""

import pytest

from layerwise.plan.state_placement import place_state


def test_nothing_moves_when_the_store_fits():
    assert place_state([10, 5, 5, 10], 100, 100) == ["ram"] * 4


def test_the_fewest_units_move_and_their_staging_is_counted():
    """Mutation: the staging slots left out of the need (``need = ram_need_bytes``): one unit
    fewer moves, and the store plus its slots is over the cap."""
    tiers = place_state([0, 10, 10, 10, 10, 0], 100, 100 - 15, slots=2)
    # moving n layers of 10 frees 10 n and costs 2 x 10 of slots: n = 4 frees 40 - 20 >= 15
    assert tiers.count("nvme") == 4 and tiers[0] == tiers[-1] == "ram"


def test_a_large_embedding_stays_in_ram_when_the_layers_make_room():
    """Mutation: largest units first without the per-size passes: the embedding (100) moves and
    its slots (3 x 100) cost more than it frees."""
    tiers = place_state([100, 20, 20, 20, 20, 20], 1000, 1000 - 30)
    assert tiers[0] == "ram" and "nvme" in tiers


def test_a_store_too_large_even_with_every_unit_moved_is_refused_in_one_line():
    with pytest.raises(ValueError, match="even with every unit's optimizer state on NVMe") as e:
        place_state([10, 10], 100, 10)
    assert "\\n" not in str(e.value)
