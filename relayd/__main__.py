"""C{python -m relayd}: the same as the C{relayd} command (L{relayd.tap.main})."""

from relayd.tap import main

if __name__ == "__main__":  # not when a tool imports every module of the package
    main()
