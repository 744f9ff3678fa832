"""Values an operator can type that no command can use (nan, inf, a file that is not a trace or a profile, an
unknown device) are usage errors (exit 2) naming the option, found before any work or request, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli

NOWHERE = ["--url", "http://127.0.0.1:9", "--key", "cs-test"]  # never reached: the value is refused first


def _refused(args: list[str], *words: str) -> str:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "cannot reach" not in res.output, res.output
    flat = " ".join(res.output.replace("│", " ").split())  # rich's error panel wraps the message
    for w in words:
        assert w in flat, res.output
    return flat


@pytest.mark.parametrize("args", [["submit", "hi", "--tbt-ms", "nan"], ["submit", "hi", "--ttft-ms", "inf"],
                                  ["submit", "hi", "--batch", "--deadline-s", "inf"], ["usage", "--days", "inf"]],
                         ids=["tbt-nan", "ttft-inf", "deadline-inf", "days-inf"])
def test_a_number_that_is_not_finite_is_refused_before_the_request(args):
    _refused([*args, *NOWHERE], "give a finite number")


def test_simulate_refuses_a_trace_or_profile_it_cannot_read_and_a_bad_period_or_out(tmp_path):
    empty, columns = tmp_path / "empty.csv", tmp_path / "columns.csv"
    empty.write_text("")
    columns.write_text("a,b\n1,2\n")
    _refused(["simulate", "--trace", str(empty), "--qps", "1"], "no rows")
    _refused(["simulate", "--trace", str(columns), "--qps", "1"], "no column 'TIMESTAMP'")
    not_json = tmp_path / "p.json"
    not_json.write_text("not json")
    _refused(["simulate", "--profile", str(not_json), "--qps", "1"], "is not a latency profile")
    _refused(["simulate", "--period", "nan", "--qps", "1"], "finite")
    _refused(["simulate", "--period", "-5", "--arrivals", "bursty", "--qps", "1"], "--period -5")
    _refused(["simulate", "--out", str(not_json), "--qps", "1"], "give a directory")


def test_profile_refuses_a_bad_device_backend_grid_or_out_before_loading_a_model(tmp_path):
    _refused(["profile", "--device", "tpu", "--out", str(tmp_path / "p.json")], "--device", "unknown device 'tpu'")
    _refused(["profile", "--backend", "onnx", "--device", "cpu", "--out", str(tmp_path / "p.json")],
             "--backend", "choose auto, vllm or torch")
    _refused(["profile", "--backend", "torch", "--grid", "huge", "--device", "cpu", "--out", str(tmp_path / "p.json")],
             "--grid", "full and small")
    _refused(["profile", "--repeats", "0"], "--repeats")
    _refused(["profile", "--out", str(tmp_path / "no" / "p.json")], "--out", "a folder that exists")


@pytest.mark.parametrize("args", [["jobs", "--json"], ["batch", "list", "--json"], ["usage", "--json"]],
                         ids=["jobs", "batch-list", "usage"])
def test_a_failure_is_one_line_on_stderr_and_leaves_stdout_to_the_json(args):
    """`coserve jobs --json | jq` gets no message to parse; the message is one line however long (80 columns here)."""
    res = CliRunner().invoke(cli, [*args, *NOWHERE], env={"COLUMNS": "80"})
    assert res.exit_code == 2 and res.stdout == "", (res.stdout, res.stderr)
    assert res.stderr.startswith("cannot reach http://127.0.0.1:9: ") and res.stderr.endswith("running?)\n"), \
        res.stderr
    assert res.stderr.count("\n") == 1 and len(res.stderr) > 80, res.stderr


def test_keys_create_refuses_a_tenant_without_a_name_and_up_a_count_of_api_processes_under_one(tmp_path):
    """A blank tenant was created, and a key for it printed; `up --api-workers 0` started an API that never came."""
    env = {"COSERVE_DATA_DIR": str(tmp_path)}
    for blank in ("", "  "):
        res = CliRunner().invoke(cli, ["keys", "create", "--tenant", blank], env=env)
        assert res.exit_code == 2 and "give the tenant a name" in res.output and "cs-" not in res.output, res.output
    assert not (tmp_path / "coserve.db").exists()  # refused before the database is made
    _refused(["up", "--api-workers", "0", "--data-dir", str(tmp_path)], "--api-workers")
    assert not (tmp_path / "credentials.json").exists()


def test_usage_refuses_days_that_reach_before_1970_naming_its_own_option():
    flat = _refused(["usage", "--days", "100000", *NOWHERE], "--days", "100000 days back is before 1970")
    assert "start_time" not in flat


def test_batch_create_refuses_a_bad_window_or_endpoint_before_uploading_the_file(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    _refused(["batch", "create", str(src), "--window", "3x", *NOWHERE], "--window", "invalid window '3x'")
    _refused(["batch", "create", str(src), "--window", "999d", *NOWHERE], "--window", "longer than")
    _refused(["batch", "create", str(src), "--endpoint", "/v1/embeddings", *NOWHERE], "--endpoint",
             "choose /v1/chat/completions")


def test_an_openai_style_base_url_ending_in_v1_reaches_the_same_api():
    """COSERVE_URL copied from an OpenAI client's base_url (http://host:8000/v1) got 404 Not Found on /v1/v1/jobs."""
    from app.cli.service_cmds import _client_config

    for url in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/"):
        assert _client_config(url, "cs-test") == ("http://127.0.0.1:8000", "cs-test")


def test_simulate_refuses_a_sweep_or_request_count_no_run_could_finish(tmp_path):
    """`--sweep 0.001,1000,0.001` built a million rates before anything else was checked; --requests had no bound.
    The profile is missing too: the old code went on to refuse it, without a word of the bound."""
    missing = str(tmp_path / "none.json")
    _refused(["simulate", "--sweep", "0.001,1000,0.001", "--profile", missing], "1000000 rates", "at most 100")
    _refused(["simulate", "--requests", "100001", "--profile", missing], "--requests", "less than or equal to 100000")
    _refused(["simulate", "--sweep", "1,100,1", "--requests", "100000", "--profile", missing],
             "no such file or shipped profile")  # the bounds are in


@pytest.mark.parametrize(("content", "says"), [
    (b"custom_id,prompt\na,hi\n", "line 1 is not JSON"), (b'[{"custom_id": "a"}]\n', "line 1 is not a JSON object"),
    (b"\n \n", "the file has no requests"), (b"\xff\xfe{}\n", "line 1 is not UTF-8 text"),
    (b'\n{"custom_id": "a"\n', "line 2 is not JSON")], ids=["csv", "array", "blank", "utf16", "cut"])
def test_batch_create_refuses_a_file_that_is_not_jsonl_before_uploading_it(tmp_path, content, says):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    _refused(["batch", "create", str(src), *NOWHERE], "PATH", says)


def test_batch_create_leaves_the_lines_after_the_first_request_to_the_api(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"custom_id": "a"}\n{oops\n')  # a BOM, as the API reads one; line 2 is the API's
    res = CliRunner().invoke(cli, ["batch", "create", str(src), *NOWHERE])
    assert res.exit_code == 2 and res.stderr.startswith("cannot reach http://127.0.0.1:9"), res.output


def test_summarize_refuses_a_bad_deadline_before_starting_a_run(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat.")
    out = str(tmp_path / "out.jsonl")
    for bogus in ("bogus", "3600", "0m", "999d"):
        _refused(["summarize", str(doc), "--deadline", bogus, "-o", out, *NOWHERE], "--deadline")


def test_summarize_cancel_refuses_documents_or_a_run_to_follow_instead_of_ignoring_them(tmp_path):
    # `--cancel ID docs/` stopped the run and left the documents unsent, saying nothing of them
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat.")
    _refused(["summarize", "--cancel", "sum_x", str(doc), *NOWHERE], "--cancel", "give no documents")
    _refused(["summarize", "--cancel", "sum_x", "--specbench", *NOWHERE], "--cancel")
    _refused(["summarize", "--cancel", "sum_x", "--run", "sum_y", *NOWHERE], "--cancel")


@pytest.mark.parametrize(("mode", "extra", "named"), [
    (["--cancel", "sum_x"], ["--limit", "3"], "--limit"), (["--cancel", "sum_x"], ["-o", "{tmp}/o.jsonl"], "--output"),
    (["--cancel", "sum_x"], ["--deadline", "9h", "--model", "m"], "--deadline, --model"),
    (["--run", "sum_x"], ["--limit", "1"], "--limit"), (["--run", "sum_x"], ["--max-summary-tokens", "9"],
                                                       "--max-summary-tokens"),
    (["--run", "sum_x"], ["--deadline", "5m", "--tier", "free"], "--deadline, --tier"),
    (["--list"], ["--deadline", "5m"], "--deadline"), (["--list"], ["-o", "{tmp}/o.jsonl"], "--output"),
    (["--list"], ["--chunk-tokens", "99"], "--chunk-tokens")],
    ids=["cancel-limit", "cancel-output", "cancel-deadline-model", "run-limit", "run-summary-tokens",
         "run-deadline-tier", "list-deadline", "list-output", "list-chunk-tokens"])
def test_summarize_refuses_options_that_do_not_apply_to_cancel_run_or_list(tmp_path, mode, extra, named):
    """`--cancel ID --limit 3`, `--run ID --deadline 5m` or `--list -o FILE` ran as if the option had not been given,
    without a word: the operator believed the run cut to 3 documents, its deadline moved, its results saved there."""
    _refused(["summarize", *mode, *(a.format(tmp=tmp_path) for a in extra), *NOWHERE], mode[0], named,
             "not apply")


@pytest.mark.parametrize("args", [["--cancel", "sum_x", "--json"], ["--run", "sum_x", "-o", "{tmp}/o.jsonl", "--json"],
                                  ["--list", "--limit", "5", "--after", "sum_a", "--json"]],
                         ids=["cancel", "run", "list"])
def test_summarize_cancel_run_and_list_take_their_own_options(tmp_path, args):
    res = CliRunner().invoke(cli, ["summarize", *(a.format(tmp=tmp_path) for a in args), *NOWHERE])
    assert res.exit_code == 2 and res.stderr.startswith("cannot reach http://127.0.0.1:9"), res.output  # it asked


@pytest.mark.parametrize("blanks", [b"\n" * 3, b"\r\n" * 3, b" \t\n" * 3, b"\x0c\x0b\n" * 3,
                                    "\u2028\u3000\x85\n".encode() * 3, b"\xef\xbb\xbf\n\n\n"],
                         ids=["lf", "crlf", "spaces", "ff-vt", "unicode", "bom"])
def test_batch_create_skips_the_blank_lines_the_api_skips_and_numbers_lines_as_it_does(tmp_path, blanks):
    """The CLI's first-request check reads through leading blank lines: only those the API's parser skips too (any
    whitespace str.strip() takes, a line cut at "\\n" alone), and a bad first request is named by the line number the
    API's error file would give it."""
    from app.batch.lines import parse_file

    src = tmp_path / "in.jsonl"
    good = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    src.write_bytes(blanks + good)
    parsed = parse_file(src.read_bytes(), "/v1/completions", 3600)
    assert [line.line_no for line in parsed.valid] == [4] and not parsed.invalid  # the API skips them
    res = CliRunner().invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", *NOWHERE])
    assert res.exit_code == 2 and res.stderr.startswith("cannot reach http://127.0.0.1:9"), res.output
    src.write_bytes(blanks + b"a,b\n")
    assert [line.line_no for line in parse_file(src.read_bytes(), "/v1/completions", 3600).invalid] == [4]
    _refused(["batch", "create", str(src), *NOWHERE], "line 4 is not JSON")


@pytest.mark.parametrize(("args", "named"), [(["status", ""], "'job_id'"), (["cancel", ""], "'job_id'"),
                                             (["batch", "status", ""], "'batch_id'"),
                                             (["batch", "cancel", ""], "'batch_id'"),
                                             (["files", "delete", ""], "'file_id'"),
                                             (["summarize", "--run", ""], "'--run'"),
                                             (["summarize", "--cancel", ""], "'--cancel'")],
                         ids=["status", "cancel", "batch-status", "batch-cancel", "files-delete", "summarize-run",
                              "summarize-cancel"])
def test_an_empty_id_is_a_usage_error_naming_its_argument(args, named):
    """`coserve status ""` asked for /v1/jobs/ (the job list, or a redirect to it) and misread the answer; an empty
    --run or --cancel was taken as not given."""
    _refused([*args, *NOWHERE], f"Invalid value for {named}", "the id is empty")
