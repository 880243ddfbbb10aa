"""The ``glassloop`` command: argparse over the library; the library never imports it."""
