"""`parwatch credential`: mint a run's key, a rank's or a node's credential from the sidecars' token."""

from __future__ import annotations

import click

from parwatch import credentials
from parwatch.tokens import TokenError, read_token


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run-id", default=None, help="The run whose key (or rank credential) to mint.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Mint this rank's credential (needs --run-id).")
@click.option("--node", default=None, help="Mint this node sidecar's credential (its name: HOSTNAME:CONTROL_PORT).")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The sidecars' token (else env PARWATCH_TOKEN).",
)
def credential(run_id, rank, node, token_file):
    """Print a credential minted from the sidecars' token (parwatch/credentials.py).

    The run's key lets torchrun's workers mint their own rank's credential without the token: put it in
    their environment as PARWATCH_RUN_KEY. A rank's credential speaks for that rank of that run only.

    \b
    Example:
      export PARWATCH_RUN_KEY=$(parwatch credential --run-id "$RUN_ID" --token-file /run/secrets/parwatch)
      torchrun --nproc-per-node 8 -m parwatch train --run-id "$RUN_ID" --parwatch-endpoint http://127.0.0.1:9401
    """
    if (node is None) == (run_id is None):
        raise click.UsageError("give --run-id (a run's key, or with --rank a rank's credential) or --node")
    if rank is not None and run_id is None:
        raise click.UsageError("--rank needs --run-id")
    try:
        secret = read_token(token_file)
    except TokenError as err:
        raise click.ClickException(str(err)) from None
    if not secret:
        raise click.ClickException(
            "no token: pass --token-file FILE (the sidecars' --token-file) or set PARWATCH_TOKEN"
        )
    if node is not None:
        click.echo(credentials.node_credential(secret, node))
    elif rank is not None:
        click.echo(credentials.rank_credential(secret, run_id, rank))
    else:
        click.echo(credentials.run_key(secret, run_id))
