"""The command-line tools, one module per tool or command group.

    style    the shared argparse style: help texts, C{PROG: error: WHAT}, exit statuses (2 usage, 1 failure)
    client   what the tools that talk to a running relayd share: its URLs, plain HTTP, stopping on a signal
    admin    C{relayd-admin}: the command line and its dispatch (the console script's entry point)
    aep      C{relayd-admin aep tail|post}
    mcp      C{relayd-admin mcp connect}
    status   C{relayd-admin status}

C{relayd-admin broker} is the broker wing's own (relayd/buzz/admin.py): it works on the broker's state
directory, not over HTTP. Only L{relayd.cli.admin} reaches a wing, to hand it that command line; the
rest speak HTTP to a running relayd and import no wing (pyproject.toml's import contracts).
"""
