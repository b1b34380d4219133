"""zones.group: the zones of one region that say the same thing share a row (CLI and pages)."""

from __future__ import annotations

from airflow_skypilot import cli, placement, zones
from airflow_skypilot.backends.base import CapacityRow
from tests.fakes import offer


def _cap(loc: str, acc: str = "A100", free: int = 16, **kw) -> CapacityRow:
    return CapacityRow("aws", loc, acc, total=None, free=free, pending=None,
                       price_per_hour=kw.pop("price", 21.96), **kw)


def test_zones_of_a_region_with_the_same_numbers_share_a_row():
    rows = [_cap("us-east-1/us-east-1a"), _cap("us-east-1/us-east-1b"),
            _cap("us-east-1/us-east-1c", free=8), _cap("us-west-2/us-west-2a"),
            _cap("us-east-1/us-east-1d"), CapacityRow("slurm", "batch", "A100", 8, 8, 0, 0.0)]
    groups = zones.group(rows, zones.capacity_key)
    assert [(g.location, len(g.rows)) for g in groups] == [
        ("us-east-1/{a,b,d}", 3), ("us-east-1/us-east-1c", 1), ("us-west-2/us-west-2a", 1),
        ("batch", 1)]
    assert groups[0].zones == ["us-east-1a", "us-east-1b", "us-east-1d"]
    assert groups[0].grouped and not groups[1].grouped


def test_error_rows_and_non_zone_locations_stay_alone():
    err = CapacityRow("aws", "us-east-1/us-east-1a", None, error="boom")
    rows = [err, err, CapacityRow("k", "ctx/ns/x", "A100", 1, 1, 0, 0.0)]
    assert [len(g.rows) for g in zones.group(rows, zones.capacity_key)] == [1, 1, 1]


def test_cli_show_gpus_groups_with_the_shared_rule():
    rows = [_cap("us-east-1/us-east-1a"), _cap("us-east-1/us-east-1b")]
    assert [r.location for r in cli._group_zones(rows)] == ["us-east-1/{a,b}"]


def test_placement_rows_group_with_rank_ranges_and_zone_free_reasons():
    offers = [offer("k8s", "ctx/ns", gpus_free=16, gpus_total=16)]
    offers += [offer("aws", f"us-east-1/us-east-1{z}", gpus_free=16, gpus_total=16, price=22)
               for z in "abcd"]
    offers += [offer("aws", f"us-east-1/us-east-1{z}", fits=False,
                     reason=f"p4d.24xlarge is not offered in us-east-1{z}") for z in "ef"]
    rows = [r.to_dict() for r in placement.rank(offers, "fastest").rows]
    groups = zones.group(rows, zones.placement_key)
    assert [(g.location, len(g.rows)) for g in groups] == [
        ("ctx/ns", 1), ("us-east-1/{a,b,c,d}", 4), ("us-east-1/{e,f}", 2)]
    assert zones.ranks_text(r["rank"] for r in groups[1].rows) == "2\u20135"


def test_ranks_text():
    assert zones.ranks_text([4, 5, 6, 9, None, 11, 12]) == "4\u20136, 9, 11\u201312"
    assert zones.ranks_text([None]) == ""
    assert zones.label("us-east-1", ["us-east-1a", "b-other"]) == "us-east-1/{a,b-other}"
