"""Names from outside never become paths: every source of a name that ends up in a file name
(a head, a validation set, a named metric, a callback's key, a key in a shared run
directory's metrics.jsonl, data.val_sets in a config) either is refused in one line where it
enters or names a file inside the run directory; nothing outside it changes (a victim folder
is hashed before and after). And the report is bounded whatever the task's size."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop
from PIL import Image
from torch import nn
from torch.nn import functional as F

from glassloop import Callback, ConfigError, Trainer
from glassloop.evaluation.metrics import classification_report
from glassloop.tracking.report import MAX_INCHES, SCATTER_MAX, write_report
from glassloop.tracking.sinks import truncate_rows

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_names")

# Each way a name can try to leave its folder or break a file.
BAD = {
    "dotdot": "..",
    "climbs": "../../victim/PWNED",
    "slash": "a/b",
    "nul": "a\x00b",
    "newline": "a\nb",
    "long": "x" * 300,
    "space": "a b",
    "hidden": ".profile",
}


def victim(tmp_path: Path) -> Path:
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "photo.png").write_bytes(b"the user's photo")
    (folder / "PWNED.png").write_bytes(b"the user's other file")
    return folder


def snapshot(root: Path, skip: Path) -> dict[str, str]:
    """Every file and folder under ``root`` outside ``skip``, with its contents' hash."""
    seen = {}
    for path in sorted(root.rglob("*")):
        if path == skip or skip in path.parents:
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        seen[str(path.relative_to(root))] = digest
    return seen


def batches(n: int, seed: int, classes: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return [(x[i : i + 20], y[i : i + 20]) for i in range(0, n, 20)]


def trainer(run_dir: Path | None = None, **kwargs: Any) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=run_dir, **kwargs,
    )  # fmt: skip


def only_inside(report: Path) -> None:
    """Every file of ``report`` is a plain file directly in it, its name a short one."""
    for path in report.rglob("*"):
        assert path.parent == report and path.is_file() and not path.is_symlink(), path
        assert len(path.name.encode()) <= 120 and not path.name.startswith("."), path.name


def test_a_shared_run_dirs_metric_keys_name_files_inside_its_report_only(tmp_path: Path) -> None:
    """A run directory is copied and shared: keys in its metrics.jsonl are input. Before, the
    key below replaced ../../victim/photo.png (report.py built the file name from it)."""
    folder = victim(tmp_path)
    run = tmp_path / "runs" / "shared"
    trainer(run).fit(batches(60, 0), batches(40, 1), epochs=2)
    hostile = {
        "val_x/../../../victim/photo": 0.5, "val_nul\x00": 0.1, "val_nl\nx": 0.2,
        "val_" + "y" * 300: 0.3, "val_größe": 0.4, "val_..": 0.6, 'val_"><img src=x>': 0.7,
        "val_$\\frac{$": 0.8,  # (matplotlib reads text between two $ as TeX)
    }  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [row for row in rows if row["kind"] == "epoch"]
    with (run / "metrics.jsonl").open("a") as handle:
        for row in epochs:
            handle.write(json.dumps({**row, **hostile}) + "\n")
    before = snapshot(tmp_path, run)
    done = run_glassloop("report", str(run))
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path, run) == before
    assert (folder / "photo.png").read_bytes() == b"the user's photo"
    report = run / "report"
    only_inside(report)
    page = (report / "index.html").read_text()
    assert "<img src=x>" not in page  # every name escaped in the page
    images = [part.split('"')[0] for part in page.split('<img src="')[1:]]
    assert len(images) == len(set(images)) == 4 + len(hostile)  # loss, step_loss, acc, lr
    for name in images:
        with Image.open(report / name) as image:
            assert image.format == "PNG"


@pytest.mark.parametrize("source", ["head", "validation set", "metric"])
@pytest.mark.parametrize("name", list(BAD.values()), ids=list(BAD))
def test_a_name_no_file_can_take_is_one_line_where_it_enters(
    tmp_path: Path, source: str, name: str
) -> None:
    folder = victim(tmp_path)
    run = tmp_path / "run"
    before = snapshot(tmp_path, run)
    with pytest.raises(ConfigError, match="cannot be used as a name") as caught:
        if source == "head":
            trainer(run, task={name: "classification"})
        elif source == "metric":
            trainer(run, metrics={name: "balanced_accuracy"})
        else:
            trainer(run).fit(batches(40, 0), {name: batches(20, 1)}, epochs=1)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300
    assert not run.exists() and snapshot(tmp_path, run) == before
    assert (folder / "PWNED.png").read_bytes() == b"the user's other file"


class TwoHeads(nn.Module):
    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.names = (first, second)
        self.body, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return dict(zip(self.names, (self.a(h), self.b(h)), strict=True))


def test_unicode_heads_and_sets_train_and_their_files_stay_in_the_run_dir(tmp_path: Path) -> None:
    first, second = "größe", "类别"
    folder = victim(tmp_path)
    run = tmp_path / "run"
    before = snapshot(tmp_path, run)
    torch.manual_seed(0)
    model = TwoHeads(first, second)

    def loss(out: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(out[first], target[first]) + F.cross_entropy(
            out[second], target[second]
        )

    def data(n: int, seed: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        return [(x, {first: y, second: y % 2}) for x, y in batches(n, seed)]

    heads = {first: "classification", second: "classification"}
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, task=heads,
            device="cpu", progress="none", run_dir=run).fit(
        data(60, 0), {"übung": data(20, 1), "ood": data(20, 2)}, epochs=1
    )  # fmt: skip
    assert snapshot(tmp_path, run) == before and folder.is_dir()
    report = run / "report"
    only_inside(report)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"val_übung_{first}_accuracy" in row and f"val_ood_{second}_accuracy" in row
    assert len(list(report.glob("*_confusion*.png"))) == 2  # one per head, in ASCII names


def test_a_callbacks_key_the_files_cannot_hold_is_one_line_and_the_run_resumes(
    tmp_path: Path,
) -> None:
    """Before: a newline in a key reached the CSV header (quoted), and every resume of the
    run directory failed in sinks.truncate_rows."""

    class Adds(Callback):
        def on_validation_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            metrics["top\nline"] = 1.0

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"the row key 'val_top\\nline' cannot be written"):
        trainer(run, callbacks=[Adds()]).fit(batches(40, 0), batches(20, 1), epochs=1)
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "top" not in header  # nothing of the row was written
    history = trainer(run).fit(batches(40, 0), batches(20, 1), epochs=2, resume="auto")
    assert [row["epoch"] for row in history][-1] == 2


def test_resume_reads_a_csv_whose_header_holds_a_quoted_newline(tmp_path: Path) -> None:
    """A run directory written before keys were checked still resumes: records, not lines."""
    text = 'kind,epoch,step,"odd\nkey",loss\r\nepoch,1,5,1.0,0.5\r\nepoch,2,10,2.0,0.4\r\n'
    (tmp_path / "metrics.csv").write_bytes(text.encode())
    truncate_rows(tmp_path, max_step=5, max_epoch=1)
    kept = (tmp_path / "metrics.csv").read_bytes().decode()
    assert kept == 'kind,epoch,step,"odd\nkey",loss\r\nepoch,1,5,1.0,0.5\r\n'


def test_a_further_validation_set_in_a_config_with_a_climbing_name_exits_2(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name, rows in (("train", 100), ("ood", 30)):
        x = rng.normal(size=(rows, 6)).astype("float32")
        np.savez(tmp_path / f"{name}.npz", x=x, y=(x[:, 0] > 0).astype("int64"))
    folder = victim(tmp_path)
    before = snapshot(tmp_path, tmp_path / "run")
    done = run_glassloop(
        "train", "--set", "data.name=npz", "--set", f"data.path={tmp_path / 'train.npz'}",
        "--set", f'data.val_sets={{"../../victim/PWNED" = "{tmp_path / "ood.npz"}"}}',
        "--set", "train.epochs=1", "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "data.val_sets name '../../victim/PWNED' cannot be used" in line
    assert snapshot(tmp_path, tmp_path / "run") == before and folder.is_dir()


# ------------------------------------------------------------------- a report of any size


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("report") / "run"
    trainer(run).fit(batches(40, 0), batches(20, 1), epochs=1)
    return run


def confusion_of(classes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, classes, (20 * classes,), generator=g)
    predicted = torch.where(torch.rand(len(labels), generator=g) < 0.7, labels, 0)
    confusion = torch.zeros(classes, classes, dtype=torch.int64)
    confusion.index_put_((labels, predicted), torch.ones_like(labels), accumulate=True)
    accuracy = float((labels == predicted).double().mean())
    report = classification_report(confusion)
    return {"confusion": confusion.tolist(), "report": report, "accuracy": accuracy}


@pytest.mark.parametrize("classes", [10, 45, 1024])
def test_a_confusion_matrix_is_bounded_and_says_its_size(small_run: Path, classes: int) -> None:
    """Before: a 1,024-class matrix was a 514-inch figure with a text per cell (32 minutes
    and 3.9 GB, still drawing); now at most MAX_INCHES, numbers only in a small one."""
    index = write_report(small_run, evaluation=confusion_of(classes))
    page = index.read_text()
    assert f"confusion matrix, {classes:,} classes" in page
    assert ("too many to label" in page) == (classes > 60)
    with Image.open(index.parent / "confusion.png") as image:
        assert max(image.size) <= MAX_INCHES * 100  # (dpi 100)
    report = (index.parent / "classification_report.txt").read_text()
    assert len(report.splitlines()) == classes + 6  # every class in the text


def test_a_language_models_vocabulary_gets_its_report_but_no_picture(small_run: Path) -> None:
    evaluation = {**confusion_of(256), "perplexity": 12.5}
    index = write_report(small_run, evaluation=evaluation)
    assert 'src="confusion.png"' not in index.read_text()
    assert "no confusion matrix: a language model&#x27;s 256 tokens" in index.read_text()


def test_a_regression_scatter_draws_a_bounded_sample_and_says_of_how_many(
    small_run: Path,
) -> None:
    true = torch.rand(16, 1, 256, 256)  # 16 images' pixels: 1,048,576 points
    predicted = true + 0.1 * torch.randn_like(true)
    state = torch.get_rng_state()
    index = write_report(small_run, predicted_vs_true=(predicted, true))
    assert torch.equal(torch.get_rng_state(), state)  # (sampled with a generator of its own)
    assert f"{SCATTER_MAX:,} of 1,048,576 validation points, at random" in index.read_text()
