"""``python -m nvdcp``: the command line (:mod:`nvdcp.cli`)."""

from nvdcp.cli import main

if __name__ == "__main__":
    main()
