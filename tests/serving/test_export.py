"""Ship the model (issue 62): ``glassloop export --format onnx|torch-export`` writes a file
checked against the model (a validation batch, batches of 1 and 7), refused above --atol with
nothing left behind; ``glassloop predict model.onnx`` prints what ``predict RUN`` prints with
torch unimportable; int8 quantization says the accuracy before and after; a forward that
branches on a tensor's value is refused naming its line, a run of the user's own class asks
for --trust-code; a text model's tokenizer travels in the metadata."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from cli_runner import run_glassloop
from PIL import Image
from torch import nn

import glassloop

DIFFERENCE = re.compile(r"largest difference to the model (\S+) on batches of \d+, 1, 7")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits run of one epoch, and two raw inputs: three images as .npy, one as a PNG."""
    folder = tmp_path_factory.mktemp("export")
    done = run_glassloop("train", "--set", "data.name=digits", "--set", "train.epochs=1",
                         "--set", "train.progress=none", "--run-dir", str(folder / "run"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    from sklearn.datasets import load_digits

    images = load_digits().images
    np.save(folder / "x.npy", images[:3])
    Image.fromarray((images[3] * 255 / 16).astype(np.uint8)).save(folder / "digit.png")
    return folder / "run"


def predict_without_torch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``glassloop predict ARGS`` in a new process where ``import torch`` fails."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from glassloop.cli.main import main\n"
            f"sys.exit(main(['predict', *{list(args)!r}]))")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_an_onnx_file_predicts_what_the_run_predicts_without_torch(run: Path) -> None:
    folder = run.parent
    done = run_glassloop("export", str(run), "--format", "onnx", "--output", str(folder / "m.onnx"))
    assert done.returncode == 0, done.stderr
    found = DIFFERENCE.search(done.stdout)
    assert found and float(found[1]) <= 1e-4 and "opset " in done.stdout, done.stdout
    model = onnx.load(str(folder / "m.onnx"))
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["output"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # (a dynamic batch)
    assert json.loads({p.key: p.value for p in model.metadata_props}["glassloop.model"])["task"]
    inputs = ["x.npy", "digit.png", "--top-k", "3"]
    expected = run_glassloop("predict", str(run), *inputs, cwd=folder)
    got = predict_without_torch(folder, "m.onnx", *inputs)
    assert got.returncode == 0, got.stderr
    assert got.stdout == expected.stdout and len(got.stdout.splitlines()) == 4, got.stdout


def test_a_torch_export_program_loads_and_computes_what_predict_computes(run: Path) -> None:
    folder = run.parent
    done = run_glassloop("export", str(run), "--format", "torch-export", "--output",
                         str(folder / "m.pt2"))  # fmt: skip
    assert done.returncode == 0 and DIFFERENCE.search(done.stdout), done.stderr
    program = torch.export.load(folder / "m.pt2").module()
    predictor = glassloop.Predictor.from_path(run)
    x = torch.from_numpy(predictor.prepare(np.load(folder / "x.npy")))
    assert torch.allclose(program(x), glassloop.predict(predictor.model, x), atol=1e-6)


def test_an_export_above_atol_or_through_a_link_is_refused_and_leaves_nothing(run: Path) -> None:
    folder = run.parent / "refused"
    folder.mkdir()
    done = run_glassloop("export", str(run), "--format", "onnx", "--output",
                         str(folder / "m.onnx"), "--atol", "0")  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "differs from the model by up to" in done.stderr and "was not written" in done.stderr
    assert os.listdir(folder) == []  # (neither the file nor its temporary)
    (folder / "elsewhere").write_text("theirs")
    (folder / "m.onnx").symlink_to(folder / "elsewhere")
    done = run_glassloop("export", str(run), "--format", "onnx", "--output", str(folder / "m.onnx"))
    assert done.returncode == 2 and "link" in done.stderr, done.stderr
    assert (folder / "elsewhere").read_text() == "theirs"


def test_int8_quantization_says_the_validation_accuracy_before_and_after(run: Path) -> None:
    folder = run.parent
    done = run_glassloop("export", str(run), "--format", "onnx", "--quantize", "int8",
                         "--output", str(folder / "q.onnx"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = re.search(r"quantized to int8 \(([\d,]+) bytes\): validation accuracy ([\d.]+)% "
                      r"before, ([\d.]+)% after", done.stdout)  # fmt: skip
    assert found and float(found[2]) > 50 and float(found[3]) > 50, done.stdout
    assert int(found[1].replace(",", "")) == (folder / "q.onnx").stat().st_size
    evaluated = run_glassloop("eval", str(run)).stdout
    assert f"accuracy: {found[2]}%" in evaluated, evaluated  # (fp32: the run's own figure)
    graph = onnx.load(str(folder / "q.onnx")).graph
    assert any("Integer" in node.op_type or "Quant" in node.op_type for node in graph.node)


BRANCHY = """
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = nn.Linear(4, num_classes)

    def forward(self, x):
        if float(x.sum()) > 0:
            return self.linear(x)
        return -self.linear(x)
"""


def test_a_forward_that_branches_on_a_value_is_refused_naming_its_line(tmp_path: Path) -> None:
    """And a run of the user's own class asks for --trust-code first, as eval does; a model
    built in Python without such a branch exports with glassloop.export_onnx."""
    (tmp_path / "branchy.py").write_text(BRANCHY)
    sets = ["data.name=synthetic", "data.num_samples=64", "data.num_features=4", "train.epochs=1",
            "train.progress=none", "model.target='branchy.py:Branchy'"]  # fmt: skip
    done = run_glassloop("train", *[f"--set={s}" for s in sets], "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    export = ["export", "run", "--format", "onnx", "--output", "m.onnx"]
    untrusted = run_glassloop(*export, cwd=tmp_path)
    assert untrusted.returncode == 2 and "--trust-code" in untrusted.stderr, untrusted.stderr
    refused = run_glassloop(*export, "--trust-code", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    line = BRANCHY.splitlines().index("        if float(x.sum()) > 0:") + 1
    assert f"branchy.py:{line}: if float(x.sum()) > 0:" in refused.stderr, refused.stderr
    assert not (tmp_path / "m.onnx").exists()
    # The Python API, on a model built in Python: what predict computes, a model ending in a
    # sigmoid too (no second one), from an example of one row (the batch axis stays dynamic)
    for name, model, task in [
        ("py", nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "classification"),
        ("sig", nn.Sequential(nn.Linear(4, 3), nn.Sigmoid()), "multilabel"),
    ]:
        x = torch.randn(5, 4)
        done_py = glassloop.export_onnx(model, tmp_path / f"{name}.onnx", x, task=task)
        assert done_py.largest_difference <= 1e-4 and done_py.batch_sizes == (5, 1, 7)
        session = onnxruntime.InferenceSession(str(tmp_path / f"{name}.onnx"))
        got = session.run(None, {"input": x[:2].numpy()})[0]
        assert np.allclose(got, glassloop.predict(model, x[:2], task=task).numpy(), atol=1e-6)
    one = glassloop.export_program(model, tmp_path / "one.pt2", torch.randn(1, 4), task=task)
    assert one.batch_sizes == (2, 1, 7)
    assert torch.export.load(tmp_path / "one.pt2").module()(torch.randn(9, 4)).shape == (9, 3)


def test_a_planted_onnx_file_or_a_bad_csv_row_is_one_line(run: Path) -> None:
    """predict reads an ONNX file's description as untrusted input; a CSV row with an empty
    cell is named by its line, never taken for a header and dropped."""
    folder = run.parent / "planted"
    folder.mkdir()
    done = run_glassloop("export", str(run), "--format", "onnx", "--output", str(folder / "m.onnx"))
    assert done.returncode == 0, done.stderr
    model = onnx.load(str(folder / "m.onnx"))
    good = dict((p.key, p.value) for p in model.metadata_props)["glassloop.model"]
    (folder / "rows.csv").write_text(
        ",".join(["1"] * 63 + [""]) + "\n" + ",".join(["2"] * 64) + "\n"
    )
    said = predict_without_torch(folder, "m.onnx", "rows.csv")
    assert said.returncode == 2 and "'rows.csv' line 1 has a non-numeric or missing value" in (
        said.stderr
    ), said.stderr
    for planted in [{"input_shape": [3, 100000, 100000]}, {"preprocessing": "abc"},
                    {"class_names": 5}, {"preprocessing": {"scale": "x"}}]:  # fmt: skip
        description = {**json.loads(good), **planted}
        del model.metadata_props[:]
        onnx.helper.set_model_props(model, {"glassloop.model": json.dumps(description)})
        onnx.save(model, str(folder / "planted.onnx"))
        said = predict_without_torch(folder, "planted.onnx", str(run.parent / "x.npy"))
        assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr
        assert "does not describe its inputs" in said.stderr, said.stderr


def test_a_text_model_carries_its_tokenizer_and_predicts_lines_without_torch(
    tmp_path: Path,
) -> None:
    words = [("great film", "pos"), ("awful film", "neg"), ("loved it", "pos"), ("hated it", "neg")]
    rows = ["text,label", *(f"{t} {i},{label}" for i in range(40) for t, label in words)]
    (tmp_path / "reviews.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "lines.txt").write_text("what a great film\nawful and hated\n")
    sets = ["data.name=text-csv", "data.path=reviews.csv", "data.vocab_size=60",
            "data.max_length=16", "model.name=text-classifier", "train.epochs=1",
            "train.progress=none"]  # fmt: skip
    done = run_glassloop("train", *[f"--set={s}" for s in sets], "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_glassloop("export", "run", "--format", "onnx", "--output", "t.onnx", cwd=tmp_path)
    assert done.returncode == 0 and DIFFERENCE.search(done.stdout), done.stdout + done.stderr
    assert "the tokenizer is in the file's metadata (glassloop.model), not in its graph" in (
        done.stdout
    )
    names = [i.name for i in onnx.load(str(tmp_path / "t.onnx")).graph.input]
    assert names[:2] == ["input_ids", "attention_mask"], names
    expected = run_glassloop("predict", "run", "lines.txt", cwd=tmp_path)
    got = predict_without_torch(tmp_path, "t.onnx", "lines.txt")
    assert got.returncode == 0 and got.stdout == expected.stdout, got.stdout + got.stderr
