"""The ``glassloop`` command: its arguments (argparse) and one ``cmd_*`` function for each of
its nine subcommands (train, verify-resume, eval, predict, doctor, report, config, runs,
export), each a few calls into the library; ``main`` maps the library's errors to the exit
codes listed once, in ``EPILOG`` (``glassloop --help`` prints them). Supervising torchrun for
``train --nproc`` is :mod:`glassloop.cli.launch`; the ``data`` commands are
:mod:`glassloop.cli.data_commands`, ``tune`` is :mod:`glassloop.cli.tune_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from glassloop.cli.data_commands import add_data_commands, cmd_data
from glassloop.cli.launch import is_worker, launch_torchrun, worker_finished, worker_started
from glassloop.cli.tune_command import add_tune_command, cmd_tune

# (No torch in either: `glassloop --help` stays fast.)
from glassloop.run_dir import layout

# Every line the CLI prints that can quote a config value, a path or a command line goes
# through it: a URI's password prints as ***.
from glassloop.storage.redaction import redact, redacted, remember_secrets_in

if TYPE_CHECKING:
    from glassloop.distributed.preemption import Preempted

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_WRITE_FAILED, EXIT_DIVERGED = 0, 1, 2, 3, 4
EXIT_NOT_EXACT = 5  # verify-resume: the killed and resumed run ended elsewhere
EXIT_INTERRUPTED = 130


EPILOG = """examples:
  glassloop train                                  the demo: tutorial MLP, bundled MNIST
  glassloop train my.toml --set optim.lr=1e-2 --run-dir runs/lr1e-2
  glassloop train my.toml --fast-dev-run           one batch of each, nothing written
  glassloop train --run-dir runs/lr1e-2 --resume    continue a run, with its own config.json
  glassloop config my.toml --set optim.lr=3e-4     the resolved config, as TOML
  glassloop eval runs/lr1e-2; glassloop predict runs/lr1e-2 digit.png --top-k 3
  glassloop doctor my.toml; glassloop report runs/lr1e-2; glassloop runs

"""
EXIT_CODES = """exit codes:
  0      success (also: resuming a run that already finished)
  1      an unexpected error: a bug (traceback printed)
  2      a usage, config, data, model or checkpoint error (one line on stderr)
  3      a checkpoint could not be written (disk full, quota; earlier checkpoints intact)
  4      training diverged (a NaN/inf loss with train.nonfinite = "raise", or too many skips)
  5      verify-resume: the killed and resumed run ended elsewhere than the straight one
  128+N  stopped by signal N after saving a checkpoint (143 SIGTERM, 130 SIGINT/Ctrl-C)
"""
EPILOG += "\n" + EXIT_CODES


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        message = redact(message)  # (an unknown argument may hold a URI)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--nproc 0`` trained as one process)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_set_option(parser: argparse.ArgumentParser, text: str) -> None:
    """The repeatable ``--set KEY=VALUE`` config override."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=text
    )


def add_trust_option(parser: argparse.ArgumentParser) -> None:
    """``--trust-code``: allow a weights file or run directory to name a model class to import."""
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="build a model whose class a run's file names (model.target in its config.json "
        "or weights) by importing it; importing runs code, so only for files you trust "
        "(built-in models and a TOML config of your own never need it)",
    )


def make_parser() -> Parser:
    from glassloop._version import __version__

    parser = Parser(
        prog="glassloop",
        description="A production PyTorch training loop you can read in one sitting.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"glassloop {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    train = commands.add_parser(
        "train",
        help="train a model from a TOML config (default: tutorial MLP on bundled MNIST)",
        description="Train a model. With no CONFIG: the tutorial MLP (784-512-512-10) on the "
        "bundled 5,000-image MNIST subset, AdamW, cosine schedule, 10 epochs.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "config", nargs="?", metavar="CONFIG", help="TOML config file (default: built-in demo)"
    )
    add_set_option(train, "override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    train.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where to write config, metrics, checkpoints and weights (default: runs/<timestamp>)",
    )
    train.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="CHECKPOINT",
        help="continue the run in --run-dir from its newest valid checkpoint (or from the "
        "CHECKPOINT directory given), at the exact next batch; without a CONFIG, with the "
        "run's own config.json",
    )
    train.add_argument(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="train with N processes on this machine (DDP; FSDP2 with --set "
        "train.strategy=fsdp): runs torchrun --standalone --nproc-per-node N -m glassloop "
        "train with the other arguments",
    )
    train.add_argument(
        "--fast-dev-run",
        action="store_true",
        help="a smoke test: one epoch of one training and one validation batch, nothing "
        "written (no run directory)",
    )
    train.add_argument(
        "--limit-batches",
        type=int,
        metavar="N",
        help="at most N training and N validation batches per epoch (train.limit_batches)",
    )
    train.add_argument(
        "--profile",
        type=positive_int,
        metavar="N",
        help="profile N optimizer steps (after one of warm-up) with torch.profiler: a trace in "
        "RUN_DIR/profile/trace.json and the top 10 operators printed",
    )
    train.add_argument(
        "--kill-at-step",
        type=positive_int,
        metavar="K",
        help="SIGKILL this process right after optimizer step K, as a power cut would (what "
        "verify-resume does; resume it with --resume)",
    )
    add_trust_option(train)
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though the config differs from the checkpoint's in keys that "
        "change the result (lr, batch size, shapes, ...)",
    )

    verify = commands.add_parser(
        "verify-resume",
        help="prove exact resume here: train straight, and killed at step K then resumed; compare",
        description="Train the config twice in a temporary directory: straight through, and "
        "killed with SIGKILL right after step K, then resumed in a new process. Print the "
        "SHA-256 of the final weights, optimizer state, other state, RNG and every reported "
        "number of both; exit 0 only when all are identical (5 otherwise).",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help="TOML config file, or a run's URL: its config.json (default: built-in demo)",
    )
    add_set_option(verify, "override a config key (repeatable), as for train")
    verify.add_argument(
        "--kill-at",
        type=positive_int,
        required=True,
        metavar="K",
        help="the optimizer step after which the second run is killed",
    )
    verify.add_argument(
        "--keep", metavar="DIR", help="keep both runs in DIR (default: a temporary directory)"
    )
    add_trust_option(verify)

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a run's weights on its validation data",
        description="Evaluate weights on the validation data of the run that made them and print "
        "the loss, accuracy and per-class report.",
    )
    evaluate.add_argument(
        "source",
        metavar="MODEL",
        help="a run directory or its URL (its final weights, else newest checkpoint), a "
        "checkpoint directory, or a .safetensors file written by glassloop export",
    )
    add_set_option(
        evaluate, "override a key of the run's config, e.g. --set data.eval_batch_size=500"
    )
    add_trust_option(evaluate)

    predict = commands.add_parser(
        "predict",
        help="class probabilities for images, .npy/.npz arrays, CSV rows or text lines",
        description="Predict with a trained model: inputs are read and normalised exactly as in "
        "training (from what the run saved); prints the top-k classes per input.",
    )
    predict.add_argument(
        "source",
        metavar="MODEL",
        help="a run directory or its URL, a checkpoint or an exported file",
    )
    predict.add_argument("inputs", nargs="+", metavar="INPUT", help="files to predict on")
    predict.add_argument("--top-k", type=int, default=1, metavar="K", help="classes per input")
    predict.add_argument("--output", metavar="FILE", help="also write the predictions as CSV")
    add_trust_option(predict)

    doctor = commands.add_parser(
        "doctor",
        help="check a config's model and data for the classic mistakes (in seconds)",
        description="Run the debugging checklist on the configured model and data: labels, "
        "class balance, input scale, softmax before CrossEntropyLoss, initial loss vs ln(C), "
        "gradient flow, overfitting one batch, train/eval mode, a learning-rate range test. "
        "Exit code 1 if a check fails.",
    )
    doctor.add_argument("config", nargs="?", metavar="CONFIG", help="TOML config (default: demo)")
    add_set_option(doctor, "override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    doctor.add_argument(
        "--output",
        metavar="DIR",
        help="a folder for the LR range plot (default: none drawn, nothing written)",
    )
    add_trust_option(doctor)

    report = commands.add_parser(
        "report",
        help="write RUN_DIR/report/: learning curves, confusion matrix, index.html",
        description="(Re)write the report of a run: plots of loss, accuracy and learning rate "
        "per epoch, the confusion matrix and classification report of its final weights on its "
        "validation data, and an index.html showing it all.",
    )
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a directory written by train, or its URL (drawn in a local copy of it)",
    )
    add_trust_option(report)

    config = commands.add_parser(
        "config",
        help="print the resolved config (defaults filled in, --set applied) as TOML",
        description="Print the config a train command would use, as TOML: every key with "
        "its value, after the CONFIG file and the --set overrides. Save it and edit it: "
        "glassloop config --set data.name=digits > my.toml",
    )
    config.add_argument(
        "config", nargs="?", metavar="CONFIG", help="TOML config file (default: built-in demo)"
    )
    add_set_option(config, "override a config key, e.g. --set optim.lr=3e-4 (repeatable)")

    runs = commands.add_parser(
        "runs",
        help="list run directories with status, last step and best metric",
        description="List the run directories under DIR (default runs/): finished, "
        "interrupted, failed or running/killed, the last step and the best metric. A sweep's "
        "folder (glassloop tune --sweep-dir DIR): a row per trial, its status, metric and "
        "the values it was given.",
    )
    runs.add_argument(
        "root", nargs="?", default="runs", metavar="DIR", help="default: runs/; or a URL"
    )
    runs.add_argument(
        "--tracking",
        action="store_true",
        help="read each run's MLflow history back (each step's last value) and compare it "
        "with its metrics.jsonl; exit 1 when one differs",
    )

    export = commands.add_parser(
        "export",
        help="write a run's model: safetensors weights, a Hugging Face folder, an ONNX file "
        "or a torch.export program",
        description="Export weights only (no optimizer state) with the model's description in "
        "the safetensors metadata; glassloop.load_model(FILE) rebuilds the model from it. "
        "--format hf: a run of a transformers or peft model as a folder in their layout. "
        "--format onnx / torch-export: the model with its task's activation (what predict "
        "prints), checked against the model on a validation batch and on batches of 1 and 7; "
        "refused (exit 2, nothing written) above --atol.",
    )
    export.add_argument(
        "source",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory or its URL, or a checkpoint directory",
    )
    export.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="PATH",
        help="the .safetensors file to write (--format hf: the new folder; onnx: model.onnx; "
        "torch-export: model.pt2)",
    )
    export.add_argument(
        "--format",
        choices=("glassloop", "hf", "onnx", "torch-export"),
        default="glassloop",
        help="glassloop: one file that glassloop.load_model rebuilds; hf: a folder that "
        "transformers' from_pretrained (a peft run: PeftModel.from_pretrained) loads; onnx: "
        "for onnxruntime (pip install 'glassloop[export]'); torch-export: torch.export.load",
    )
    export.add_argument(
        "--atol",
        type=float,
        default=1e-4,
        metavar="A",
        help="onnx, torch-export: the largest absolute difference to the model allowed "
        "(default 1e-4, for fp32)",
    )
    export.add_argument(
        "--quantize",
        choices=("int8",),
        help="onnx: onnxruntime's dynamic int8 quantization, with the validation accuracy "
        "before and after",
    )
    add_trust_option(export)
    export.add_argument(
        "--merged",
        action="store_true",
        help="--format hf: the adapter merged into its base (only from the trained model, in "
        "Python: glassloop.export_hf(model, folder, merged=True))",
    )
    add_data_commands(commands, positive_int)
    add_tune_command(commands, positive_int)
    return parser


def default_run_dir(prefix: str = "") -> Path:
    base = Path("runs") / (prefix + time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """``--fast-dev-run``, ``--limit-batches N`` and ``--profile N`` as the config keys they
    set (after the ``--set`` ones, so the flag wins), recorded in config.json as any key."""
    overrides = []
    if args.fast_dev_run:
        overrides += ["train.limit_batches=1", "train.epochs=1"]
    elif args.limit_batches is not None:
        overrides.append(f"train.limit_batches={args.limit_batches}")
    if args.profile:
        overrides.append(f"train.profile={args.profile}")
    return overrides


def cmd_train(args: argparse.Namespace) -> int:
    if sys.stderr.isatty() and not is_worker():  # (torch's import alone takes seconds)
        print("glassloop: starting (importing torch, then data and model) ...", file=sys.stderr)
    from glassloop.config.assemble import build
    from glassloop.config.schema import load_config
    from glassloop.distributed.world import shutdown
    from glassloop.errors import GlassloopError
    from glassloop.storage.file_names import is_url
    from glassloop.tracking.provenance import paths_from

    args.config = own_config(args)  # (--resume alone: the run's config.json)
    # Read (and a run's config.json that names code refused) before any process is started.
    overrides = [*args.overrides, *flag_overrides(args)]
    cfg = load_config(args.config, overrides, trust_code=args.trust_code)
    args.names_code = bool(cfg.model.target)
    if args.nproc and "WORLD_SIZE" not in os.environ:
        return launch_torchrun(args.nproc, args.argv)
    if args.fast_dev_run:
        if args.resume or args.run_dir:
            raise GlassloopError("--fast-dev-run writes nothing: drop --run-dir and --resume")
        run = build(cfg, run_dir=None)
        print("fast dev run: 1 training and 1 validation batch, nothing written")
        try:
            run.trainer.fit(run.train_loader, run.validation, epochs=1)
        finally:
            shutdown()
        print("fast dev run: ok")
        return EXIT_OK
    if args.resume == "auto" and not args.run_dir:
        raise GlassloopError("--resume needs --run-dir DIR: the run to continue")
    # (a URL stays one: glassloop.run_dir.remote keeps the run there, through a local copy)
    run_dir = args.run_dir if is_url(args.run_dir) else Path(args.run_dir or default_run_dir())
    if not args.run_dir and "WORLD_SIZE" in os.environ:
        raise GlassloopError("with several processes, pass --run-dir: every process must agree")
    files_from = started_in(args)
    run = build(cfg, run_dir=run_dir, files_from=files_from, resume=args.resume)
    if args.kill_at_step:
        from glassloop.tools.verify_resume import KillAfterStep

        run.trainer.callbacks.append(KillAfterStep(args.kill_at_step))
    try:
        with paths_from(files_from):  # (its run.json keeps naming where its paths point)
            history = run.trainer.fit(
                run.train_loader,
                run.validation,  # (and data.val_sets, by name)
                epochs=cfg.train.epochs,
                resume=args.resume,
                allow_config_change=args.allow_config_change,
            )
    finally:
        shutdown()
    if not run.trainer.world.is_main:
        return EXIT_OK
    last = history[-1] if history else {}
    for line in run.warnings:  # (said before the header too: it has scrolled away by now)
        print(line)
    if "val_accuracy" in last:  # the demo's last line (the README quotes it)
        print(f"final validation accuracy: {100 * last['val_accuracy']:.2f}%")
    return EXIT_OK


def interrupted(command: str, err: KeyboardInterrupt) -> str:
    """What a Ctrl-C that reached the command says. In ``fit`` SIGINT stops with a checkpoint
    (:class:`Preempted`), unless ``train.stop_signals`` leaves it out; before ``fit`` (imports,
    data, the model) nothing has been saved yet, and a newcomer should not have to wonder."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_globals.get("__name__"), tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    if command != "train":
        return "interrupted"
    if ("glassloop.loop", "fit") in frames:
        return (
            "interrupted during training (SIGINT is not in train.stop_signals): this moment "
            "was not saved; the checkpoints saved before it are intact"
        )
    return "interrupted during start-up, before the first step: nothing was saved yet"


def stopped_line(args: argparse.Namespace, stop: Preempted) -> str:
    """What a stopped run says last: where it stopped and the command that continues it (a
    run directory's URL through the one redaction, as every other line)."""
    return redact(f"glassloop: {stop.summary}{resume_hint(args, stop)}")


def resume_hint(args: argparse.Namespace, stop: Preempted) -> str:
    """The command that continues a stopped run, ready to paste (the run's own config.json
    is what ``--resume`` alone reads)."""
    if stop.checkpoint is None:
        return ""
    run_dir = args.run_dir or str(Path(stop.checkpoint).parents[1])  # (.../checkpoints/step-N)
    nproc = ["--nproc", str(args.nproc)] if getattr(args, "nproc", 0) else []
    # (a run of the user's own class: its config.json names code, which --resume refuses)
    trust = ["--trust-code"] if getattr(args, "names_code", False) else []
    command = ["glassloop", "train", "--run-dir", run_dir, *nproc, "--resume", *trust]
    return f"; continue with: {shlex.join(command)}"


def own_config(args: argparse.Namespace) -> str | None:
    """``train --run-dir DIR --resume`` without a config: the run's own config.json (what it
    was started with), said in one line; else the config given."""
    from glassloop.storage.file_names import is_url

    if args.config is not None or not args.resume or not args.run_dir or is_url(args.run_dir):
        return args.config  # type: ignore[no-any-return]
    own = Path(args.run_dir) / layout.CONFIG
    if own.is_symlink() or not own.is_file():  # (a link: never read; the run refuses it)
        return None
    if not is_worker():  # (the launcher of --nproc said it)
        print(f"resuming with the run's own config: {own}")
    return str(own)


def started_in(args: argparse.Namespace) -> Path | None:
    """The folder a run this train command reads again (the run it resumes, or the run
    whose config.json it trains from) was started in: where its relative paths point
    (:func:`glassloop.config.assemble.located`); ``None`` for a new config."""
    from glassloop.storage.file_names import is_url
    from glassloop.tracking.provenance import recorded_folder

    local = args.run_dir and not is_url(args.run_dir)  # (a remote run: its own config.json)
    if args.resume and local and (folder := recorded_folder(Path(args.run_dir))):
        return folder
    if args.config and Path(args.config).name == layout.CONFIG:
        return recorded_folder(Path(args.config).parent)
    return None


def cmd_verify_resume(args: argparse.Namespace) -> int:
    from glassloop.config.schema import load_config
    from glassloop.tools.verify_resume import Interrupted, TrainingRuns

    load_config(args.config, args.overrides, trust_code=args.trust_code)  # (before any run)
    try:
        # The handlers around the folder: a SIGTERM stops the child, removes the folder, and
        # is said in one line with exit code 128 + N.
        with TrainingRuns() as children, tempfile.TemporaryDirectory(prefix="glassloop-v") as tmp:
            ours, theirs = verify_in(Path(args.keep) if args.keep else Path(tmp), args, children)
    except Interrupted as stop:
        print(f"glassloop: {stop}", file=sys.stderr)
        return 128 + stop.signum
    width = max(len(name) for name in ours)
    print(f"{'':<{width}}  {'straight through':<16}  {'killed and resumed':<18}")
    for name in ours:
        same = ours[name] == theirs[name]
        verdict = "identical" if same else "DIFFERENT"
        print(f"{name:<{width}}  {ours[name][:16]}  {theirs[name][:16]}    {verdict}")
    exact = ours == theirs
    print("resume is exact" if exact else "resume is NOT exact: see the rows marked DIFFERENT")
    return EXIT_OK if exact else EXIT_NOT_EXACT


def verify_in(where: Path, args: argparse.Namespace, children: Any) -> tuple[dict[str, str], ...]:
    """The three runs of verify-resume in ``where`` (straight, killed, resumed), each a child
    of ``children`` (:class:`~glassloop.tools.verify_resume.TrainingRuns`); their fingerprints."""
    from glassloop.errors import CheckpointWriteError, GlassloopError
    from glassloop.tools.verify_resume import fingerprints
    from glassloop.tracking.runs import summarise

    sets = [f"--set={item}" for item in args.overrides]
    config = [args.config] if args.config else []
    straight, killed = where / "straight", where / "killed"
    trust = ["--trust-code"] if args.trust_code else []
    train = [sys.executable, "-m", "glassloop", "train", *config, *sets, *trust]
    runs = [
        ("straight through", [*train, "--run-dir", str(straight)]),
        (
            f"killed after step {args.kill_at}",
            [*train, "--run-dir", str(killed), "--kill-at-step", str(args.kill_at)],
        ),
        ("resumed", [*train, "--run-dir", str(killed), "--resume"]),
    ]
    too_late = GlassloopError(
        f"verify-resume: the run ended before step {args.kill_at}; choose a smaller --kill-at"
    )
    for name, command in runs:
        print(f"verify-resume: {name} ...", flush=True)
        done = children.run(command)
        expected = -signal.SIGKILL if name.startswith("killed") else 0
        if done.returncode != expected:
            if expected and done.returncode == 0:
                raise too_late
            tail = "\n".join(done.stderr.strip().splitlines()[-3:])
            # (a run that could not write, --keep on a full disk: exit 3 as train says it)
            failed = (
                CheckpointWriteError if done.returncode == EXIT_WRITE_FAILED else GlassloopError
            )
            raise failed(f"verify-resume: the {name} run failed:\n{tail}")
        if name == "straight through":  # said now, not after a second whole run
            ended = summarise(straight)
            if ended is not None and ended.status == "finished" and ended.step < args.kill_at:
                raise too_late
    return fingerprints(straight), fingerprints(killed)


def cmd_eval(args: argparse.Namespace) -> int:
    from glassloop.tools.run_evaluation import evaluate_run

    print(
        as_shown(str(evaluate_run(args.source, args.overrides, trust_code=args.trust_code)), args)
    )
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    from glassloop.errors import GlassloopError, writing
    from glassloop.tools.prediction import (
        Inputs,
        Predictor,
        format_predictions,
        write_predictions,
    )

    if args.top_k < 1:
        raise GlassloopError("predict: --top-k must be >= 1")
    predictor: Inputs
    if args.source.endswith(".onnx"):  # (onnxruntime and numpy: no torch on this path)
        from glassloop.serving.onnx_predictor import OnnxPredictor

        predictor = OnnxPredictor(args.source)
    else:
        predictor = Predictor.from_path(args.source, trust_code=args.trust_code)
    sources, probs = predictor.predict_files(args.inputs)
    for warning in predictor.warnings:
        print(warning, file=sys.stderr)
    predictions = predictor.top_k(sources, probs, args.top_k)
    print(format_predictions(predictions))
    if args.output:
        output = Path(args.output)
        with writing("predict", output.parent, "nothing was written"):
            write_predictions(predictions, output)
        print(f"wrote {args.output}")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from glassloop.config.schema import load_config
    from glassloop.tools.checklist import run_doctor
    from glassloop.tracking.launched import since_launch

    cfg = load_config(args.config, args.overrides, trust_code=args.trust_code)
    output = Path(args.output) if args.output else None  # (nothing left behind unasked)
    checks = run_doctor(cfg, output=output)
    for check in checks:
        print(redact(check.line()))  # (a check may quote data.path)
    failed = sum(c.status == "FAIL" for c in checks)
    warned = sum(c.status == "WARN" for c in checks)
    # The command's own time, its imports and data included (what the user waited for).
    print(f"{len(checks)} checks, {failed} failed, {warned} warnings, {since_launch():.1f}s")
    return EXIT_ERROR if failed else EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from glassloop.tools.run_evaluation import report_run

    index = report_run(args.run_dir, trust_code=args.trust_code)
    where = " (in the local copy; the bucket is unchanged)" if args.local_copy else ""
    print(f"report: {index}{where}")
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    import tomli_w

    from glassloop.config.schema import load_config, to_dict

    # A password in tracking.uri prints as ***: credentials belong in the environment
    # (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), not in a config file.
    print(tomli_w.dumps(redacted(to_dict(load_config(args.config, args.overrides)))), end="")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    from glassloop.errors import GlassloopError
    from glassloop.tracking.runs import format_runs, list_runs

    root = Path(args.root)
    if not root.is_dir():
        raise GlassloopError(f"runs: '{root}' is not a directory")
    if (root / "sweep.json").is_file() and not args.tracking:  # (tuning.report.INDEX)
        from glassloop.tuning.report import list_trials  # (imports torch: only for a sweep)

        print(list_trials(root))
        return EXIT_OK
    summaries = list_runs(root)
    listed = format_runs(summaries, name=lambda path: as_shown(str(path), args))
    print(listed if summaries else as_shown(f"no runs under '{root}'", args))
    if not args.tracking:
        return EXIT_OK
    from glassloop.tracking.trackers import check_tracked

    found = [root / layout.TRACKING] if (root / layout.TRACKING).is_file() else []
    found += sorted(root.glob("*/tracking.json"))  # (DIR itself may be one run)
    checked = [check_tracked(path.parent) for path in found]
    for _, line in checked:
        print(line)
    return EXIT_OK if all(same for same, _ in checked) else 1


def cmd_export(args: argparse.Namespace) -> int:
    from glassloop.errors import writing
    from glassloop.tools.export import export_model

    with writing("export", Path(args.output).parent, "nothing was written"):
        if args.format in ("onnx", "torch-export"):
            from glassloop.serving.run_export import export_run

            export_run(
                args.source,
                args.output,
                args.format,
                atol=args.atol,
                quantize=args.quantize,
                trust_code=args.trust_code,
            )
            return EXIT_OK
        if args.format == "hf":
            from glassloop.tools.export import export_run_hf

            path = export_run_hf(args.source, args.output, merged=args.merged)
            files = sorted(p.name for p in path.iterdir())
            print(f"exported {path}/ ({', '.join(files)})")
            return EXIT_OK
        path = export_model(args.source, args.output)
    print(f"exported {path} ({path.stat().st_size} bytes)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    if is_worker():  # of --nproc: it dies with torchrun, which dies with the launcher
        worker_started()
    code = run_command(argv)
    if is_worker():  # its code goes to the launcher, which exits with it
        worker_finished(code)
    return code


# Arguments that name a file or folder glassloop reads or writes here.
PATH_ARGUMENTS = ("run_dir", "source", "inputs", "output", "config", "keep", "root")
# The argument that names the run a command reads: a URL there is read from object storage.
READS_A_RUN = {
    "eval": "source",
    "predict": "source",
    "export": "source",
    "report": "run_dir",
    "runs": "root",
    "verify-resume": "config",
}


def read_remote_paths(args: argparse.Namespace, held: contextlib.ExitStack) -> None:
    """A URL where a command reads a run is pulled into a local copy of the command's, held
    by ``held`` (:mod:`glassloop.run_dir.remote_read`; nothing is written to the bucket); a
    URL anywhere else a command reads or writes a local path is one line, never a local folder
    named ``s3:`` (``train --run-dir`` keeps its run there: docs/storage.md)."""
    from glassloop.errors import GlassloopError
    from glassloop.storage.file_names import is_url
    from glassloop.storage.redaction import redact

    args.local_copy = None  # (the local copy and the URL it stands for, to print the URL)
    for name in PATH_ARGUMENTS:
        values = getattr(args, name, None)
        if args.command == "train" and name == "run_dir":
            own = args.resume and args.config is None and is_url(str(values))
            args.config = own_remote_config(str(values), held) if own else args.config
            continue
        for value in values if isinstance(values, list) else [values]:
            if not (isinstance(value, str) and is_url(value)):
                continue
            if READS_A_RUN.get(args.command) == name:
                setattr(args, name, pull_run(args, value, held))
                continue
            raise GlassloopError(
                f"{args.command}: {redact(value)!r} is a URL; this argument is a local path "
                "(a run on object storage is read from its URL by eval, predict, export, "
                "report, runs and verify-resume, and written by train --run-dir)"
            )


def own_remote_config(url: str, held: contextlib.ExitStack) -> str | None:
    """``train --run-dir URL --resume`` without a config: the run's own config.json, as for a
    local run (it trained the demo's config and was refused as a config change), read into
    a folder held for the command; ``None``: the URL holds no run yet."""
    from glassloop.run_dir.remote_read import read_config

    folder = Path(held.enter_context(tempfile.TemporaryDirectory(prefix="glassloop-config-")))
    own = read_config(url, folder)
    if own is not None and not is_worker():  # (the launcher of --nproc said it)
        print(f"resuming with the run's own config: {redact(url.rstrip('/'))}/{layout.CONFIG}")
    return str(own) if own is not None else None


def pull_run(args: argparse.Namespace, url: str, held: contextlib.ExitStack) -> str:
    """The local copy of the run at ``url`` (verify-resume: of its config.json)."""
    from glassloop.run_dir.remote_read import read_run, read_runs

    if args.command == "runs":
        remote = held.enter_context(read_runs(url))
    else:  # (verify-resume takes the run's config.json, or the run)
        remote = held.enter_context(read_run(url.removesuffix(f"/{layout.CONFIG}")))
    args.local_copy = (str(remote.local), remote.shown)
    print(f"read {remote.shown} into a local copy, {remote.local}", file=sys.stderr)
    if args.command == "verify-resume":
        return str(remote.local / layout.CONFIG)
    return str(remote.local)


def as_shown(text: str, args: argparse.Namespace) -> str:
    """``text`` with the local copy of a remote run (:func:`pull_run`) named by its URL."""
    if args.local_copy is None:
        return text
    local, url = args.local_copy
    return text.replace(local, url)


def run_command(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the command, map errors to exit codes (EPILOG)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser().parse_args(argv)
    args.argv = argv  # (what a worker of --nproc runs, less --nproc)
    for value in argv:  # (a URI's secrets: replaced wherever a driver quotes them)
        remember_secrets_in(value)
    warnings.showwarning = show_warning  # (and what libraries warn or log, below)
    from glassloop.errors import GlassloopWarning  # (the console says them: never twice)

    warnings.filterwarnings("ignore", category=GlassloopWarning)
    logging.lastResort = RedactedLastResort()
    from glassloop.distributed.preemption import Preempted
    from glassloop.errors import CheckpointWriteError, GlassloopError, NonFiniteError

    commands = {
        "train": cmd_train,
        "verify-resume": cmd_verify_resume,
        "eval": cmd_eval,
        "predict": cmd_predict,
        "doctor": cmd_doctor,
        "report": cmd_report,
        "config": cmd_config,
        "runs": cmd_runs,
        "export": cmd_export,
        "data": cmd_data,
        "tune": cmd_tune,
    }
    try:
        with contextlib.ExitStack() as held:  # (a remote run's local copy, while read)
            read_remote_paths(args, held)
            code = commands[args.command](args)
            sys.stdout.flush()  # (a reader gone away is found here, not at the exit's flush)
        return code
    except BrokenPipeError:
        if args.command in ("train", "verify-resume"):
            raise  # (training cut by a closed pipe is not a normal end)
        # The reader went away (`glassloop runs | head`): a normal end for a command that
        # only prints; stdout goes nowhere from here, so the exit's flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    # A config or data error quotes the value it refuses: a tracking URI's password too.
    except CheckpointWriteError as err:
        print(f"glassloop: error: {redact(str(err))}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except NonFiniteError as err:
        print(f"glassloop: error: {redact(str(err))}", file=sys.stderr)
        return EXIT_DIVERGED
    except GlassloopError as err:
        print(f"glassloop: error: {redact(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except Preempted as stop:
        if stop.signum == signal.SIGINT and sys.stderr.isatty():
            print(file=sys.stderr)  # the terminal's "^C" stays on the bar's line, alone
        print(stopped_line(args, stop), file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt as err:
        what = interrupted(args.command, err)
        print(f"{chr(10) if sys.stderr.isatty() else ''}glassloop: {what}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # a bug, or a library's own error: its traceback, through the redaction
        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return EXIT_ERROR


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` through the redaction: a library's warning may quote a URI
    it was handed."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    (file or sys.stderr).write(redact(text))


class RedactedLastResort(logging.Handler):
    """What a library logs with no handler configured (logging's last resort: a driver's
    retry warnings), through the redaction, to stderr as before."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(redact(self.format(record)) + "\n")
        except Exception:
            self.handleError(record)


if __name__ == "__main__":
    raise SystemExit(main())
