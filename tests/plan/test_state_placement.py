"""Which units' state goes on NVMe (``plan.state_placement.place_state``)."""

import pytest

from layerwise.plan.state_placement import place_state


def test_nothing_moves_when_the_store_fits():
    assert place_state([10, 5, 5, 10], 100, 100) == ["ram"] * 4


def test_the_fewest_units_move_and_their_staging_is_counted():
    """Mutation: the staging slots left out of the need (``need = ram_need_bytes``): one unit
    fewer moves, and the store plus its slots is over the cap."""
    tiers = place_state([0, 10, 10, 10, 10, 10, 0], 100, 100 - 15)
    # moving n layers of 10 frees 10 n and costs 3 x 10 of slots: n = 5 frees 50 - 30 >= 15
    assert tiers.count("nvme") == 5 and tiers[0] == tiers[-1] == "ram"


def test_a_large_embedding_stays_in_ram_when_the_layers_make_room():
    """Mutation: largest units first without the per-size passes: the embedding (100) moves and
    its slots (3 x 100) cost more than it frees."""
    tiers = place_state([100, 20, 20, 20, 20, 20], 1000, 1000 - 30)
    assert tiers[0] == "ram" and "nvme" in tiers


def test_weights_and_gradients_move_too_when_the_state_alone_is_not_enough():
    """Mutation: the source and gradient slots left out of ``staging``: fewer units go
    ``nvme-all`` and the store plus its slots is over the cap."""
    state, source, grad = [8] * 10, [2] * 10, [2] * 10
    need = sum(state) + sum(source) + sum(grad)  # 120
    # every state on NVMe: 120 - 80 + 3 x 8 = 64; each nvme-all unit frees 4, its slots cost
    # 3 x 2 + 2 x 2 = 10: 64 + 10 - 4 n <= 50 needs n = 6
    tiers = place_state(state, need, 50, source, grad)
    assert tiers.count("nvme-all") == 6 and tiers.count("nvme") == 4


def test_a_store_too_large_even_with_every_unit_moved_is_refused_in_one_line():
    with pytest.raises(ValueError, match="even with every unit's optimizer state on NVMe") as e:
        place_state([10, 10], 100, 10)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="state, weights and gradients on NVMe"):
        place_state([10, 10], 100, 10, [5, 5], [5, 5])
