"""``glassloop train`` and ``glassloop eval``.

Exit codes: 0 success; 1 an unexpected error (a bug: traceback printed); 2 a usage, config,
data or model error (one line on stderr); 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def make_parser() -> Parser:
    from glassloop import __version__

    parser = Parser(
        prog="glassloop",
        description="A production PyTorch training loop you can read in one sitting.",
    )
    parser.add_argument("--version", action="version", version=f"glassloop {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    train = commands.add_parser(
        "train",
        help="train a model from a TOML config (default: tutorial MLP on bundled MNIST)",
        description="Train a model. With no CONFIG: the tutorial MLP (784-512-512-10) on the "
        "bundled 5,000-image MNIST subset, AdamW, cosine schedule, 10 epochs.",
    )
    train.add_argument(
        "config", nargs="?", metavar="CONFIG", help="TOML config file (default: built-in demo)"
    )
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    train.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where to write config, metrics and weights (default: runs/<timestamp>)",
    )

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a run's final weights on its validation data",
        description="Evaluate RUN_DIR/model.safetensors on the run's validation data and print "
        "the loss, accuracy and per-class report.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by train")
    evaluate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run's config, e.g. --set data.eval_batch_size=500",
    )
    return parser


def default_run_dir() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from glassloop.build import build
    from glassloop.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    run = build(cfg, run_dir=run_dir)
    history = run.trainer.fit(run.train_loader, run.val_loader, epochs=cfg.train.epochs)
    last = history[-1]
    if "val_accuracy" in last:
        print(f"final validation accuracy: {100 * last['val_accuracy']:.2f}%")
    print(f"run directory: {run_dir}")
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    from glassloop.build import build
    from glassloop.checkpoint import load_weights
    from glassloop.config import load_config
    from glassloop.errors import GlassloopError
    from glassloop.metrics import format_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise GlassloopError(f"eval: '{run_dir}' is not a run directory (no config.json)")
    cfg = load_config(run_dir / "config.json", args.overrides)
    run = build(cfg)
    load_weights(run.trainer.model, run_dir / "model.safetensors")
    result = run.trainer.evaluate(run.val_loader)
    print(f"validation samples: {len(run.splits.y_val)}")
    print(f"loss: {result['loss']:.6f}")
    if "accuracy" in result:
        print(f"accuracy: {100 * result['accuracy']:.2f}%")
        print()
        print(format_report(result["report"], result["accuracy"], run.splits.class_names))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from glassloop.errors import GlassloopError

    try:
        if args.command == "train":
            return cmd_train(args)
        return cmd_eval(args)
    except GlassloopError as err:
        print(f"glassloop: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("glassloop: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
