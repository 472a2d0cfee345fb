"""`megapkl plot` draws the per-update quantile metrics as a median with a p10-p90 band."""
import json


def test_quantile_metrics_plot_as_a_band(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megapkl.train.metrics_log import read_metrics
    from megapkl.analysis.plot import _draw, plot_runs

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for u in range(10):
            f.write(json.dumps({"step": u, "sis/accept_rate_p10": 0.8, "sis/accept_rate_p50": 0.9,
                                "sis/accept_rate_p90": 0.95, "loss": 1.0}) + "\n")
    files = {p.name for p in plot_runs([tmp_path], tmp_path / "plots")}
    assert "sis_accept_rate_p50.png" in files
    rows = read_metrics(tmp_path)
    for metric, bands in (("sis/accept_rate_p50", 1), ("loss", 0)):
        fig, ax = plt.subplots()
        _draw(ax, [("run", rows)], metric, 0.1)
        assert len(ax.collections) == bands, metric      # the shaded p10-p90 region
        plt.close(fig)
