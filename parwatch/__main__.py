"""`python -m parwatch ...` is `parwatch ...` (for machines where the script dir is not on PATH)."""

from parwatch.cli.main import cli

cli(prog_name="parwatch")
