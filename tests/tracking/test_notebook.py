"""Notebooks (issue 50), in a real Jupyter kernel (nbclient + ipykernel), as a user runs them:

* docs/quick-start.ipynb runs: ``fit`` shows tqdm's widget bar and one line per epoch, no step
  lines; the history, the trainer and an evaluation come back as HTML tables, the run read
  back with its report's curves, a sweep's trials (``glassloop.tune``) as a table; every
  number and the weights equal the same code run as a script.
* "Interrupt kernel" mid-run checkpoints the last step; running the same cell again (the same trainer
  object) resumes and ends with the uninterrupted run's weights and rows, bit for bit; once
  more after the end, it says in one line that the run is finished.
* "Interrupt kernel" during the first step, then during a validation (each sent once the cell
  says it got there): the step is checkpointed, then the validation owed; a new trainer in a
  new cell resumes, bitwise.
* Outside a notebook nothing of this is imported (IPython, ipywidgets, tqdm's notebook bar).
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.xdist_group("test_notebook")
NOTEBOOK = Path(__file__).parents[2] / "docs" / "quick-start.ipynb"
TIMING = ("seconds", "samples_per_s", "checkpoint_s")
WIDGET = "application/vnd.jupyter.widget-view+json"


def code_cells(notebook: Any) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def as_script(notebook: Any, folder: Path) -> Path:
    """The notebook's code, run as a script in ``folder`` (a fresh interpreter)."""
    folder.mkdir()
    script = folder / "script.py"
    script.write_text("\n\n".join(code_cells(notebook)) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def rows(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def texts(cell: Any) -> str:
    """What a cell printed (streams) and the plain text of what it displayed."""
    out = []
    for output in cell.get("outputs", []):
        out.append(output.get("text", ""))
        out.append(output.get("data", {}).get("text/plain", ""))
        out.extend(output.get("traceback", []))
    return "\n".join(out)


def test_the_docs_page_shows_the_notebooks_code() -> None:
    """docs/notebooks.md (the site's view of the notebook) holds its code cells, in order."""
    page = (NOTEBOOK.parent / "notebooks.md").read_text(encoding="utf-8")
    shown = re.findall(r"^```python\n(.*?)\n^```", page, re.DOTALL | re.MULTILINE)
    assert shown == code_cells(nbformat.read(NOTEBOOK, as_version=4))


def test_the_quick_start_notebook_shows_a_live_bar_and_tables(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (tmp_path / "kernel").mkdir()
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path / "kernel")}}).execute()  # fmt: skip
    code = [c for c in notebook.cells if c.cell_type == "code"]
    _, fit, history, trainer, evaluation, read_back, sweep, trials = code
    # the bar: tqdm's widget (epoch bars and validation bars), one line per epoch, no step line
    shown = [o for o in fit.outputs if o.output_type == "display_data"]
    assert shown and all(WIDGET in o.data for o in shown)
    assert {o.data["text/plain"].split(":")[0].split(" (")[0] for o in shown} == {
        *(f"epoch {e}/5" for e in range(1, 6)),
        "validate",
    }
    printed = "".join(o.text for o in fit.outputs if o.output_type == "stream")
    assert "loss:" not in printed
    assert [line.split("  ")[0] for line in printed.splitlines() if line.startswith("epoch ")] == [
        f"epoch {e}/5" for e in range(1, 6)
    ]
    # tables
    [table] = [o.data["text/html"] for o in history.outputs if "text/html" in o.get("data", {})]
    assert table.count("<tr>") == 1 + 5 and "val_accuracy" in table
    [card] = [o.data["text/html"] for o in trainer.outputs if "text/html" in o.get("data", {})]
    assert "glassloop.Trainer" in card and "runs/notebook" in card and "epoch 5, step" in card
    [report] = [o.data["text/html"] for o in evaluation.outputs if "text/html" in o.get("data", {})]
    assert "confusion" in report and "per class" in report and "f1-score" in report
    # every number and the weights: the script's
    script = as_script(notebook, tmp_path / "script")
    run, again = tmp_path / "kernel" / "runs" / "notebook", script / "runs" / "notebook"
    assert rows(run) == rows(again)
    assert (run / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert f"'accuracy': {rows(run)[-1]['val_accuracy']}" in texts(evaluation)
    # the run read back: its summary, and its report's curves inline
    [view] = [o.data["text/html"] for o in read_back.outputs if "text/html" in o.get("data", {})]
    assert view.count("<img") >= 4 and "finished" in view
    # the sweep: a line per trial, the best last; its trials as a table; the script's numbers
    said = texts(sweep)
    assert "best trial: " in said and "sweeps/notebook/report/index.html" in said, said
    [table] = [o.data["text/html"] for o in trials.outputs if "text/html" in o.get("data", {})]
    assert table.count("COMPLETE") == 2 and "params_optim.lr" in table, table
    for n in range(2):
        trial = f"sweeps/notebook/trial-{n:04d}"
        assert rows(tmp_path / "kernel" / trial) == rows(script / trial)
        [last] = [row for row in rows(script / trial) if row["kind"] == "epoch"][-1:]
        assert f"trial {n}: val_loss {last['val_loss']:.6g}" in said, said


def test_interrupting_the_kernel_mid_run_and_running_the_cell_again_resumes_bitwise(
    tmp_path: Path,
) -> None:
    """The quick start's own cells: Kernel -> Interrupt in the middle of the fit, the same
    cell again (the same trainer) resumes, once more says it finished, and the run is bitwise
    the script's. The interrupt is sent once and every wait is bounded (nbclient's
    interrupt_on_timeout sent it again every 2 s to a kernel whose reply it had missed, and
    the suite hung for 54 minutes)."""
    from jupyter_client.manager import start_new_kernel

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    setup, fit = [c for c in notebook.cells if c.cell_type == "code"][:2]
    # long enough to be interrupted in the middle: 120 epochs of 23 steps (~4.5 s)
    fit.source = fit.source.replace("epochs=5", "epochs=120")
    notebook.cells = [setup, fit]
    (tmp_path / "kernel").mkdir()
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path / "kernel"))
    try:
        assert "Error" not in run_cell(client, setup.source)
        stopped = run_cell(client, fit.source, manager.interrupt_kernel, after_s=2.0)
        assert "Preempted" in stopped and "SIGINT" in stopped, stopped[-2000:]
        resumed = run_cell(client, fit.source)  # the same cell, the same trainer
        finished = run_cell(client, fit.source)  # and once more: finished
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    run = tmp_path / "kernel" / "runs" / "notebook"
    assert "resumed from" in resumed and "Error" not in resumed, resumed[-2000:]
    meta = [json.loads(p.read_text()) for p in run.glob("checkpoints/*/meta.json")]
    assert meta and all(m["world_size"] == 1 for m in meta)
    assert "run already finished at step 2760 (epoch 120/120); nothing to do" in finished
    script = as_script(notebook, tmp_path / "script")
    again = script / "runs" / "notebook"
    assert rows(run) == rows(again)
    assert (run / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_outside_a_notebook_nothing_of_it_is_imported(tmp_path: Path) -> None:
    probe = (
        "import sys, torch\n"
        "from torch import nn\n"
        "import glassloop\n"
        "model = nn.Linear(2, 2)\n"
        "t = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "
        "nn.CrossEntropyLoss(), progress='auto')\n"
        "t.fit([(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))], epochs=1)\n"
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'tqdm.notebook', 'ipykernel') "
        "if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"


def test_what_a_fit_gives_back_is_still_a_list_and_a_dict() -> None:
    """The views change how a notebook shows them, not what they are: code that reads a
    history or an evaluation goes on as before; ``history.frame()`` is pandas'."""
    import torch
    from torch import nn

    import glassloop

    glassloop.seed_everything(0)
    model = nn.Linear(3, 2)
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none")  # fmt: skip
    data = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(3)]
    history = trainer.fit(data, data, epochs=2)
    assert isinstance(history, list) and history == trainer.history == trainer.record.history
    frame = history.frame()
    assert list(frame["epoch"]) == [1, 2] and list(frame["val_loss"]) == [
        row["val_loss"] for row in history
    ]
    result = trainer.evaluate(data)
    assert isinstance(result, dict) and result["loss"] == history[-1]["val_loss"]
    assert json.loads(json.dumps(result)) == dict(result)
    assert "<table>" in result._repr_html_() and "confusion" in result._repr_html_()


SLOW_VALIDATION = """
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import glassloop
from glassloop.config import DataConfig
from glassloop.data import load_splits, make_loader

data = load_splits(DataConfig(name="digits"))


class Said(glassloop.Callback):
    def on_validation_start(self, trainer):
        print(f"validating after step {trainer.state.step}", flush=True)


class SlowStart(nn.Module):  # its first forward takes a second (as a compile or a big model's)
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 10))
        self.started = False

    def forward(self, x):
        if not self.started:
            self.started = True
            print("first forward", flush=True)
            time.sleep(1)
        return self.net(x)


class Slow:  # a validation that takes a while: 45 batches of 30 ms
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            time.sleep(0.03)
            yield batch


def make():
    glassloop.seed_everything(0)
    model = SlowStart()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return glassloop.Trainer(model, optimizer, nn.CrossEntropyLoss(), run_dir="runs/slow",
                             callbacks=[Said()])


train = make_loader((data.x_train, data.y_train), batch_size=64, shuffle=True, seed=0)
val = Slow(DataLoader(TensorDataset(data.x_val, data.y_val), batch_size=8))
trainer = make()
"""
FIT = 'history = trainer.fit(train, val, epochs=3, resume="auto")'


def run_cell(
    client: Any, code: str, interrupt: Any = None, *, at: str = "", after_s: float = -1.0,
    limit_s: float = 300.0,
) -> str:  # fmt: skip
    """``code`` in the kernel; what it printed (and its traceback). ``interrupt``: the kernel
    manager's, called once (Kernel -> Interrupt) when the cell has printed ``at``, or
    ``after_s`` seconds after it was sent. The cell's end (the kernel's idle status for it) is
    waited for at most ``limit_s`` seconds, then the test fails saying so."""
    msg_id, said, start = client.execute(code), [], time.monotonic()
    while (waited := time.monotonic() - start) < limit_s:
        if interrupt is not None and 0 <= after_s <= waited:
            interrupt()
            interrupt = None
        try:
            msg = client.get_iopub_msg(timeout=0.2 if interrupt is not None else 5.0)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        said.append(content.get("text", "") + "\n".join(content.get("traceback", [])))
        if interrupt is not None and at and at in "".join(said):
            interrupt()
            interrupt = None
        if msg["msg_type"] == "status" and content["execution_state"] == "idle":
            return "".join(said)
    raise AssertionError(
        f"waited {limit_s:.0f} s for the kernel to finish the cell (its idle status); the cell "
        f"said: {''.join(said)[-2000:]}"
    )


def test_interrupting_the_first_step_then_a_validation_then_resuming_in_a_new_cell_is_bitwise(
    tmp_path: Path,
) -> None:
    """Kernel -> Interrupt during the first step: it ends, and is checkpointed; the same cell
    again resumes, and is interrupted while epoch 1's validation runs: the checkpoint is of
    epoch 1's last step with its validation still owed; a new cell with a new trainer resumes
    from it, validates first, and ends bitwise the uninterrupted script's run."""
    from jupyter_client.manager import start_new_kernel

    (tmp_path / "kernel").mkdir()
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path / "kernel"))
    try:
        assert "Error" not in run_cell(client, SLOW_VALIDATION)
        first = run_cell(client, FIT, manager.interrupt_kernel, at="first forward")
        assert "Preempted" in first and "after step 1" in first, first[-2000:]
        checkpoints = tmp_path / "kernel" / "runs" / "slow" / "checkpoints"
        assert json.loads((checkpoints / "step-00000001" / "meta.json").read_text())["step"] == 1
        stopped = run_cell(client, FIT, manager.interrupt_kernel, at="validating after step 23")
        assert "resumed from" in stopped and "at step 1 " in stopped, stopped[-2000:]
        assert "Preempted" in stopped and "SIGINT" in stopped, stopped[-2000:]
        checkpoint = checkpoints / "step-00000023"
        state = json.loads((checkpoint / "state.json").read_text())
        assert state["loop"]["validation_due"] == "epoch", state["loop"]
        resumed = run_cell(client, f"trainer = make()\n{FIT}")  # a new cell, a new trainer
        assert "resumed from" in resumed and "Error" not in resumed, resumed[-2000:]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    folder = tmp_path / "script"
    folder.mkdir()
    (folder / "script.py").write_text(f"{SLOW_VALIDATION}\n{FIT}\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "script.py"], cwd=folder, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run, again = tmp_path / "kernel" / "runs" / "slow", folder / "runs" / "slow"
    assert rows(run) == rows(again)
    assert (run / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_a_run_read_back_shows_its_curves_and_never_reads_through_a_link(tmp_path: Path) -> None:
    import glassloop
    from glassloop.errors import GlassloopError

    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    (run / "run.json").write_text('{"status": "finished", "step": 4, "epoch": 2}')
    (run / "metrics.jsonl").write_text(
        '{"kind": "epoch", "epoch": 1, "step": 2, "val_loss": 0.5}\n'
        '{"kind": "epoch", "epoch": 2, "step": 4, "val_loss": 0.25}\n'
    )
    (run / "report" / "loss.png").write_bytes(b"\x89PNG own")
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"\x89PNG not the run's")
    (run / "report" / "lr.png").symlink_to(outside)
    view = glassloop.load_run(run)
    assert [p.name for p in view.pictures] == ["loss.png"]
    shown = view._repr_html_()
    assert shown.count("<img") == 1 and "finished" in shown and shown.count("<tr>") >= 2 + 7
    assert "val_loss 0.25 (epoch 2)" in repr(view)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "run.json").write_text('{"status": "finished"}')
    (tmp_path / "linked" / "report").symlink_to(run / "report")
    assert glassloop.load_run(tmp_path / "linked").pictures == []
    with pytest.raises(GlassloopError, match="is not a run directory"):
        glassloop.load_run(tmp_path / "elsewhere")


def test_without_ipywidgets_the_bar_is_html_redrawn_in_place(tmp_path: Path) -> None:
    """A kernel where ipywidgets cannot be imported: each bar is one HTML output, updated in
    place through its display id (nbclient applies the updates), emptied when it closes."""
    code = (
        "import sys\n"
        "sys.modules['ipywidgets'] = None  # (not installed)\n"
        "import torch\n"
        "from torch import nn\n"
        "import glassloop\n"
        "glassloop.seed_everything(0)\n"
        "model = nn.Linear(4, 2)\n"
        "trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "                            nn.CrossEntropyLoss())\n"
        "data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(5)]\n"
        "history = trainer.fit(data, data, epochs=2)\n"
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    updates: list[str] = []

    class Watching(NotebookClient):  # type: ignore[misc]
        def process_message(self, msg: Any, cell: Any, cell_index: int) -> Any:
            if msg["msg_type"] == "update_display_data":
                updates.append(msg["content"]["data"]["text/html"])
            return super().process_message(msg, cell, cell_index)

    Watching(notebook, timeout=120, kernel_name="python3",
             resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    outputs = notebook.cells[0].outputs
    bars = [o for o in outputs if o.output_type == "display_data"]
    assert len(bars) == 4 and all(WIDGET not in o.data for o in bars)  # 2 epochs, 2 validations
    assert all(o.data["text/html"] == "" for o in bars)  # (closed, not left)
    assert any("<progress value='0' max='5'></progress> <code>validate:" in h for h in updates)
    assert any("<code>epoch 2/2" in h for h in updates), updates
    printed = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "loss:" not in printed and printed.count("epoch 1/2  train_loss") == 1
