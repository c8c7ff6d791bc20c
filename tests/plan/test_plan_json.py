"""Plan JSON: the current format round-trips, and a plan file of any other format version is
refused in one line."""

import json

import pytest

from layerwise.plan.plan import FORMAT_VERSION, Plan


def test_a_plan_file_round_trips_with_its_internal_tiers(tmp_path):
    """A saved plan loads back equal, its internal tiers and format version kept; bad internal
    tiers are refused."""
    kept = Plan(["device"] * 4, internal_tiers=["device", "host", "recompute", "host"])
    path = tmp_path / "plan.json"
    kept.save(path)
    written = json.loads(path.read_text())
    assert written["format_version"] == FORMAT_VERSION == 4
    assert written["boundary_tiers"] == ["device"] * 4
    assert Plan.load(path) == kept
    assert Plan.load(path).internal_tiers == ["device", "host", "recompute", "host"]
    with pytest.raises(ValueError, match="unknown internal tiers"):
        Plan(["device"] * 2, internal_tiers=["nvme", "device"])
    with pytest.raises(ValueError, match="2 internal tiers but 3 boundary"):
        Plan(["device"] * 3, internal_tiers=["host", "device"])


def test_a_plan_file_of_another_format_version_is_refused_in_one_line(tmp_path):
    """An older, a newer and an unversioned plan file are refused in one line naming the file,
    its version, the one read and the command that writes it again.

    Mutation seen failing: accepting version 3 (``refuse_version`` letting it through)."""
    current = Plan.every_k(4, 2).to_dict()
    path = tmp_path / "plan.json"
    for version in (1, 3, 5, None):
        d = {**current, "format_version": version}
        if version is None:
            del d["format_version"]
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError) as err:
            Plan.load(path)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg == (f"{path}: plan format_version {version}; this layerwise reads 4: write it "
                       "again with `layerwise plan ... --out FILE`"), msg
    with pytest.raises(ValueError, match="^plan format_version 3; this layerwise reads 4"):
        Plan.from_dict({**current, "format_version": 3})
