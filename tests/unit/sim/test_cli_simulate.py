import json

from typer.testing import CliRunner

from app.cli import cli


def test_simulate_sweep_prints_a_table_and_writes_results_and_plot(tmp_path):
    res = CliRunner().invoke(cli, ["simulate", "--profile", "synthetic-a100-llama3-8b", "--trace", "code",
                                   "--sweep", "1:3:2", "--policies", "qoserve,sarathi-fcfs", "--requests", "40",
                                   "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "qoserve" in res.output and "sarathi-fcfs" in res.output and "SLO" in res.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["qps"] for r in data["results"]["qoserve"]] == [1.0, 3.0]
    assert all(0.0 <= r["violation_rate"] <= 1.0 for rows in data["results"].values() for r in rows)
    png = (tmp_path / "violations.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_without_a_rate_sweeps_around_the_capacity(tmp_path):
    res = CliRunner().invoke(cli, ["simulate", "--profile", "cpu-smollm2-135m", "--trace", "conv",
                                   "--policies", "qoserve", "--requests", "60", "--out", str(tmp_path)],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "up to ~" in res.output and "--sweep " in res.output
    rows = json.loads((tmp_path / "results.json").read_text())["results"]["qoserve"]
    assert len(rows) == 8
    # the knee is inside: the first rate is within 1% violations, the last one is not
    assert rows[0]["violation_rate"] <= 0.01 < rows[-1]["violation_rate"]


def test_simulate_with_trace_arrivals_states_the_cost_model_error(tmp_path):
    res = CliRunner().invoke(cli, ["simulate", "--profile", "synthetic-a100-llama3-8b", "--trace", "conv",
                                   "--qps", "2", "--arrivals", "trace", "--policies", "qoserve,silo",
                                   "--requests", "30", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "MAPE" in res.output and "random-forest" in res.output and "trace arrivals" in res.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["arrivals"] == "trace" and set(data["cost_model_mape"]) == {"piecewise-linear", "random-forest"}
    assert [r["n"] for r in data["results"]["silo"]] == [30]


def test_simulate_rejects_an_unknown_arrival_process():
    res = CliRunner().invoke(cli, ["simulate", "--profile", "synthetic-a100-llama3-8b", "--qps", "1",
                                   "--arrivals", "uniform", "--requests", "5"])
    assert res.exit_code != 0


def test_simulate_refuses_bad_options_before_it_fits_the_profile(monkeypatch):
    """`simulate --policies bogus` fitted the profile's cost model (seconds) before it refused the name: every option
    is a usage error (exit 2, naming it) before any work."""
    from gpu_runtime.costmodel import profile

    def fitted(path):
        raise AssertionError(f"the cost model of {path} was fitted before the options were checked")

    monkeypatch.setattr(profile, "scheduling_cost_model", fitted)
    for args, says in ((["--policies", "qoserve,bogus"], "no scheduler bogus"),
                       (["--policies", " , "], "name at least one scheduler"),
                       (["--trace", "nowhere.csv"], "--trace 'nowhere.csv'"),
                       (["--sweep", "3,1,1"], "LAST >= FIRST"),
                       (["--qps", "0"], "--qps 0.0: give a rate > 0"),  # the last --qps counts
                       (["--qps", "-2"], "--qps -2.0: give a rate > 0"),
                       (["--sweep", "0,2,1"], "FIRST must be > 0"),
                       (["--sweep", "-1,2,1"], "FIRST must be > 0"),
                       (["--arrivals", "uniform"], "choose from poisson"),
                       (["--free-share", "1.5"], "--free-share"),
                       (["--profile", "no-such-profile", "--policies", "bogus"], "no scheduler bogus")):
        res = CliRunner().invoke(cli, ["simulate", "--qps", "1", *args], env={"COLUMNS": "200"})
        out = " ".join(res.output.replace("\u2502", " ").split())
        assert res.exit_code == 2 and says in out, (args, res.output)
