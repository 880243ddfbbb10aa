"""A secret in a tracking URI leaves no trace: for every way of writing one (with a scheme or
without, a user part, a bare token, a query or fragment token, percent-encoded), a training
run from the command line against a real ``mlflow server`` writes it to no file of the run
directory, the data cache or the working directory, and prints it neither in glassloop's own
lines nor in MLflow's ("View run at ...")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_glassloop, run_python, sets

from glassloop.options import TrackingConfig
from glassloop.storage.redaction import redact, redacted

pytest.importorskip("mlflow")  # the dev extra installs it
from test_tracking import batches, mlflow_server, trainer

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_redaction")

SECRET = "Hunter2xyz"  # (alphanumeric: its percent-encoded form is itself)


@pytest.mark.parametrize(
    "text",
    [
        f"http://ann:{SECRET}@host:5000",
        f"https://{SECRET}@host",  # a bare token as the user part
        f"http://ann:p@{SECRET}@host/path",  # a raw `@` in the password
        f"http://ann:{SECRET}%40x@host",  # `@` percent-encoded in the password
        f"http://ann%3A{SECRET}@host",  # `:` percent-encoded in the user part
        f"ann:{SECRET}@host:5000",  # no scheme
        f"{SECRET}@host:5000",
        f"{SECRET}@host/mlflow",
        f"ann%3A{SECRET}%40host:5000",  # no scheme, all of it percent-encoded
        f"http%3A%2F%2Fann%3A{SECRET}%40host",
        f"data: 'http:/ann:{SECRET}@host/x.csv' not found",  # a path merged its `//`
        f"http://host/?token={SECRET}&x=1",
        f"http://host/?x=1&api_key={SECRET}",
        f"http://host/?pass%77ord={SECRET}",  # the key percent-encoded
        f"http://host/?token%3D{SECRET}",
        f"http://host/?next=http%3A%2F%2Fann%3A{SECRET}%40other",  # a URI inside a query
        f"http://host/#token={SECRET}",
        f"http://host/#access_token={SECRET}&state=1",
        f"tracking.uri={SECRET}@host",  # after a key that names a URI
        f"(tracking.uri '{SECRET}@host': MLflow takes ...)",
        f'{{"uri": "{SECRET}@host"}}',
        f"View run x at: http://ann:{SECRET}@127.0.0.1:5000/#/experiments/1/runs/0",
    ],
)
def test_redact_leaves_no_trace_of_a_secret_in_any_uri_form(text: str) -> None:
    assert SECRET not in redact(text) and "***" in redact(text)


@pytest.mark.parametrize(
    "text",
    [
        "host:5000",
        "http://127.0.0.1:5000",
        "sqlite:///mlflow.db",
        "sqlite:////tmp/a b/mlflow.db",
        "file.py:Net",
        "/data/photo%20one.png",
        "http://host:5000/#/experiments/1/runs/abc",
        "http://host/?page=2&sort=asc",
        "ann@example.com",  # an address is not a credential (the module docstring)
        "git@github.com:org/repo",
    ],
)
def test_redact_keeps_what_holds_no_secret(text: str) -> None:
    assert redact(text) == text


def test_a_config_reads_a_value_under_a_uri_key_as_a_uri() -> None:
    config = {"tracking": {"uri": f"{SECRET}@host", "tags": {"owner": "ann@example.com"}}}
    assert redacted(config) == {"tracking": {"uri": "***@host", "tags": config["tracking"]["tags"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real ``mlflow server`` for the module (it takes seconds to start)."""
    with mlflow_server(tmp_path_factory.mktemp("server")) as (url, _):
        yield url


URIS = {
    "user-part": "http://ann:{secret}@{host}",
    "bare-token": "http://{secret}@{host}",
    "encoded-at-in-password": "http://ann:{secret}%40x@{host}",
    "encoded-colon": "http://ann%3A{secret}@{host}",
    "no-scheme": "ann:{secret}@{host}",
    "no-scheme-token": "{secret}@{host}",
    "no-scheme-encoded": "ann%3A{secret}%40{host}",
    "query-token": "http://{host}/?token={secret}",
    "encoded-query-key": "http://{host}/?pass%77ord={secret}",
    "fragment-token": "http://{host}/#access_token={secret}",
}


@pytest.mark.parametrize("form", URIS)
def test_no_uri_form_leaves_a_trace_in_files_or_output(
    form: str,
    server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache, cwd, run = tmp_path / "cache", tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(cache))
    # A server that refuses the request must cost no retries (seconds each).
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = URIS[form].format(secret=SECRET, host=server.removeprefix("http://"))
    options = ["data.name=digits", "train.epochs=1", "train.progress=none", "train.limit_batches=2"]
    tracking = ["tracking.backend=mlflow", f"tracking.uri={uri}"]
    done = run_glassloop("train", "--run-dir", str(run), *sets(options + tracking), cwd=cwd)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr + "".join(capfd.readouterr())
    assert SECRET not in said, said
    if "@" in URIS[form] and "://" in URIS[form]:  # the server took it: MLflow's run link
        assert f"View run run at: http://***@{server.removeprefix('http://')}/#/" in said, said
        assert (run / "tracking.json").is_file()
    else:  # the warning that turns tracking off names the URI, redacted
        assert "warning: tracking (mlflow) failed" in said and "***" in said, said
    files = [path for folder in (run, cache, cwd) for path in folder.rglob("*")]
    assert {"config.json", "run.json", "meta.json", "index.html"} <= {p.name for p in files}
    leaks = [
        p for p in files if SECRET in str(p) or (p.is_file() and SECRET.encode() in p.read_bytes())
    ]
    assert leaks == [], leaks
    assert "***" in (run / "config.json").read_text()


def test_the_run_link_mlflow_prints_from_python_is_redacted_too(
    server: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    uri = f"http://ann:{SECRET}@{server.removeprefix('http://')}"
    trainer(tmp_path / "run", TrackingConfig(backend="mlflow", uri=uri)).fit(batches(), epochs=1)
    out, err = capfd.readouterr()
    assert "View run run at: http://***@" in out and SECRET not in out + err, out + err


# What the CLI prints about a value it refuses (a config or data error, an argparse error)
# quotes the value: each form of a secret there leaves no trace in stdout or stderr.
REFUSED = {
    "backend": [f"tracking.backend=http://ann:{SECRET}@host"],
    "tags": [f"tracking.tags=http://ann:{SECRET}@host"],
    "uri-list": [f'tracking.uri=["http://ann:{SECRET}@host"]'],
    "data-path": ["data.name=csv", f"data.path=http://ann:{SECRET}@host/x.csv"],
}


@pytest.mark.parametrize("form", REFUSED)
def test_a_refused_value_is_printed_redacted(
    form: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    done = run_glassloop("train", "--run-dir", "r", *sets(REFUSED[form]), cwd=tmp_path)
    said = done.stdout + done.stderr + "".join(capfd.readouterr())
    assert done.returncode == 2 and said.count("\n") == 1, said
    assert SECRET not in said and "***" in said, said
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_unknown_argument_is_printed_redacted(tmp_path: Path) -> None:
    done = run_glassloop("eval", "run", f"http://ann:{SECRET}@host", cwd=tmp_path)
    assert done.returncode == 2 and SECRET not in done.stdout + done.stderr, done.stderr
    assert "***" in done.stderr


def test_glassloop_config_prints_the_uri_redacted(tmp_path: Path) -> None:
    done = run_glassloop("config", *sets([f"tracking.uri=http://ann:{SECRET}@host"]))
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr and 'uri = "http://***@host"' in done.stdout


def test_what_a_library_raises_warns_or_logs_in_the_cli_is_redacted(tmp_path: Path) -> None:
    """A library's own exception (a traceback, exit 1), its warning and what it logs with no
    handler configured quote the URI they were handed in any shape (``TOKEN@bucket``: no
    pattern tells it from an e-mail address): each passes the one redaction, since the
    command line named that URI (a new process, as the console script runs)."""
    token = "Zq9TokenOnly"
    script = f"""
import logging, sys, warnings
import glassloop.cli.main as cli_main

def library_code(args):  # (what a driver does with the URL it was handed)
    warnings.warn("retrying {token}@bucket", UserWarning, stacklevel=1)
    logging.getLogger("a.driver").warning("HEAD %s@bucket failed", "{token}")
    raise RuntimeError('Invalid bucket name "{token}@bucket"')

cli_main.cmd_config = library_code
sys.exit(cli_main.main(["config", "--set", "tracking.uri=http://{token}@host"]))
"""
    done = run_python(script, tmp_path)
    assert done.returncode == 1 and "Traceback" in done.stderr, done.stderr
    assert token not in done.stdout + done.stderr, done.stderr
    assert 'Invalid bucket name "***@bucket"' in done.stderr
    assert "retrying ***@bucket" in done.stderr and "HEAD ***@bucket failed" in done.stderr
