"""`python -m qeffect` (used on the GPU machine, where the package is on PYTHONPATH, not installed)."""

from qeffect.cli.app import main

if __name__ == "__main__":
    main()
