"""C{python -m relayd}: the same as the C{relayd} command (L{relayd.tap.main})."""

from relayd.tap import main

main()
