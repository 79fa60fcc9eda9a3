"""--price-series: each node-second paid at the price of its time, against a
run at one price (a constant series) and a hand-computed bill (a series that
changes while the fleet does)."""
import json

import pytest

from sim import command
from sim.price_series import PriceSeries, read_prices
from sim.profiles import PROFILES
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event

BERT = PROFILES["bert-large"]


def run(events, **options):
    opt = Options(max_stages=1, free_checkpoints=True, surplus="keep", **options)
    return ClusterSimulator(BERT, 2, "redo", opt).run(events, hours=2.0)


def test_a_constant_series_bills_as_one_price():
    events = [Event(0.0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)] + [Event(1800.0, "remove", "n1", "b")]
    one = run(events, spot_price=0.7)
    series = run(events, price_series=PriceSeries(600.0, (0.7,) * 3))  # the last price holds to the end
    assert series["cost_per_hour"] == pytest.approx(one["cost_per_hour"], rel=1e-4)
    assert series["mean_spot_price"] == pytest.approx(0.7)


def test_each_node_second_is_paid_at_the_price_of_its_time():
    """Four nodes for the first hour, three after (n3 is preempted at 3600 s, and
    the trace gives none back); the price is 1 USD for 30 minutes, then 2, then 4
    from the 90th minute. The bill by hand: 4 x 0.5 x 1 + 4 x 0.5 x 2 + 3 x 0.5 x 2
    + 3 x 0.5 x 4."""
    events = [Event(0.0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)] + [Event(3600.0, "remove", "n3", "b")]
    out = run(events, price_series=PriceSeries(1800.0, (1.0, 2.0, 2.0, 4.0)))
    bill = 4 * 0.5 * 1 + 4 * 0.5 * 2 + 3 * 0.5 * 2 + 3 * 0.5 * 4
    assert out["cost_per_hour"] * 2.0 == pytest.approx(bill, rel=1e-3)
    assert out["mean_spot_price"] == pytest.approx(bill / (out["mean_nodes"] * 2.0), rel=1e-3)


@pytest.mark.parametrize("doc,says", [
    ({"metadata": {"gap_seconds": 60}, "data": [0.5, -1]}, "price 1 must be above 0"),
    ({"metadata": {"gap_seconds": 0}, "data": [0.5]}, "gap_seconds must be a positive number"),
    ({"metadata": {"gap_seconds": 60}, "data": []}, "data must be a list of 1 to"),
    ({"data": [0.5]}, "expected {\"metadata\""),
    ({"metadata": {"gap_seconds": 60}, "data": [True]}, "price 0 must be above 0"),
])
def test_a_bad_price_series_is_one_line(tmp_path, capsys, doc, says):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(doc))
    code = command.main(["--trace", "traces/bursty-zones.csv", "--hours", "1", "--stages", "2",
                         "--price-series", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_the_reader_reads_what_was_written(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [0.3, 0.31, 1]}))
    assert read_prices(str(path)) == PriceSeries(300.0, (0.3, 0.31, 1.0))
